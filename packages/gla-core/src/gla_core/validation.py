"""Validation of one request: arrays and keywords in, a `Call` and normalized keywords out.

This is the only place arguments are checked; implementations can rely on what it
guarantees (see `gla_core.ops`). Checks on `cu_seqlens` values run only when the array
is concrete, so validation works unchanged under `jax.jit` with traced boundaries.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gla_core.errors import (
    DTypeError,
    InvalidArgumentError,
    ShapeError,
    UnknownArgumentError,
    UnknownOpError,
    describe,
)
from gla_core.ops import CHUNK_SIZES, SIGNATURES
from gla_core.records import Call

# FLA's chunk_gla calls the per-key gate `g`; fused_recurrent_gla calls it `gk`.
KEYWORD_ALIASES = {"gla": {"g": "gk"}}


def bind_arguments(op: str, arrays: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Binds positional arrays and keywords of `op` to its full signature.

    Returns every argument of the op by name, defaults filled in. Raises for unknown
    ops, too many positional arrays, duplicated or unknown keywords.
    """
    if op not in SIGNATURES:
        raise UnknownOpError(f"op: expected one of {sorted(SIGNATURES)}, got {op!r}")
    signature = SIGNATURES[op]
    if len(arrays) > len(signature.arrays):
        raise UnknownArgumentError(
            f"{op}: expected at most {len(signature.arrays)} positional arrays "
            f"({', '.join(signature.arrays)}), got {len(arrays)}; pass the others by keyword"
        )
    bound: dict[str, Any] = dict(zip(signature.arrays, arrays, strict=False))
    known = set(signature.arrays) | set(signature.keywords) | {"interpret"}
    for name, value in kwargs.items():
        canonical = KEYWORD_ALIASES.get(op, {}).get(name, name)
        if canonical not in known:
            raise UnknownArgumentError(f"{op}: unexpected keyword argument {name!r}; expected one of {sorted(known)}")
        if canonical in bound:
            raise UnknownArgumentError(
                f"{op}: argument {canonical!r} given more than once" + (f" (as {name!r})" if name != canonical else "")
            )
        bound[canonical] = value
    for name in signature.arrays:
        if bound.get(name) is None:
            raise InvalidArgumentError(f"{name}: required array argument of {op} is missing")
    for name, default in signature.keywords.items():
        bound.setdefault(name, default)
    bound.setdefault("interpret", None)
    return bound


# --------------------------------------------------------------------------- checks


def _shape(name: str, x: Any) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if shape is None or getattr(x, "dtype", None) is None:
        raise DTypeError(f"{name}: expected an array, got {type(x).__name__}")
    return tuple(int(d) for d in shape)


def _require_float(name: str, x: Any) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise DTypeError(f"{name}: expected a floating dtype (bfloat16, float16, float32, float64), got {x.dtype}")


def _require_shape(name: str, x: Any, expected: tuple[int, ...], layout: str) -> None:
    got = _shape(name, x)
    if got != expected:
        if len(got) != len(expected):
            raise ShapeError(f"{name}: expected rank {len(expected)} {layout} = {expected}, got shape {got}")
        raise ShapeError(f"{name}: expected shape {layout} = {expected}, got {got}")


def _require_rank(name: str, x: Any, rank: int, layout: str) -> tuple[int, ...]:
    shape = _shape(name, x)
    if len(shape) != rank:
        raise ShapeError(f"{name}: expected rank {rank} {layout}, got shape {shape}")
    if any(d == 0 for d in shape[2:]):
        raise ShapeError(f"{name}: expected non-empty head and feature dims in {layout}, got shape {shape}")
    return shape


def _require_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentError(f"{name}: expected a bool, got {value!r}")
    return bool(value)


def _is_concrete(x: Any) -> bool:
    """True when the values of `x` can be read on the host (not a tracer or a shape struct)."""
    return not isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct))


def resolve_scale(scale: Any, key_dim: int) -> float:
    """The attention scale: `key_dim ** -0.5` when None, else a finite positive number."""
    if scale is None:
        return key_dim**-0.5
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise InvalidArgumentError(f"scale: expected a finite positive real number or None, got {scale!r}")
    value = float(scale)
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(f"scale: expected a finite positive real number or None, got {scale!r}")
    return value


def _chunk_size(value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or int(value) not in CHUNK_SIZES:
        raise InvalidArgumentError(f"chunk_size: expected one of {CHUNK_SIZES}, got {value!r}")
    return int(value)


def check_cu_seqlens(cu_seqlens: Any, batch: int, seq_len: int) -> tuple[Any, int]:
    """Validates `cu_seqlens` and returns it as int32 with the number of sequences N.

    Structure (rank, dtype, B == 1) is always checked; values (starts at 0, ends at T,
    non-decreasing) only when the array is concrete.
    """
    shape = _shape("cu_seqlens", cu_seqlens)
    if len(shape) != 1 or shape[0] < 2:
        raise ShapeError(f"cu_seqlens: expected a 1-D array [N+1] with N >= 1, got shape {shape}")
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise DTypeError(f"cu_seqlens: expected an integer dtype (int32), got {cu_seqlens.dtype}")
    if batch != 1:
        raise ShapeError(
            f"cu_seqlens: packed sequences need batch size B == 1 (flatten to [1, sum(T), ...]), got B = {batch}"
        )
    if _is_concrete(cu_seqlens):
        values = np.asarray(cu_seqlens).astype(np.int64)
        if values[0] != 0:
            raise InvalidArgumentError(f"cu_seqlens: expected first value 0, got {values[0]}")
        if values[-1] != seq_len:
            raise InvalidArgumentError(f"cu_seqlens: expected last value T = {seq_len}, got {values[-1]}")
        steps = np.diff(values)
        if (steps < 0).any():
            where = int(np.argmax(steps < 0))
            raise InvalidArgumentError(
                f"cu_seqlens: expected non-decreasing values, got {values[where]} then {values[where + 1]} "
                f"at positions {where} and {where + 1}"
            )
    if isinstance(cu_seqlens, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, jnp.int32), shape[0] - 1
    return jnp.asarray(cu_seqlens).astype(jnp.int32), shape[0] - 1


def _check_state(initial_state: Any, expected: tuple[int, ...]) -> None:
    _require_shape("initial_state", initial_state, expected, "[N, H, K, V]")
    _require_float("initial_state", initial_state)


def _interpret(value: Any, default: bool) -> bool:
    if value is None:
        return default
    return _require_bool("interpret", value)


# --------------------------------------------------------------------------- per op


def _validate_qkv(op: str, args: dict[str, Any], grouped_values: bool) -> tuple[int, int, int, int, int, int]:
    q, k, v = args["q"], args["k"], args["v"]
    batch, seq_len, num_heads, key_dim = _require_rank("q", q, 4, "[B, T, H, K]")
    _require_float("q", q)
    _require_shape("k", k, (batch, seq_len, num_heads, key_dim), "[B, T, H, K] (as q)")
    vb, vt, num_value_heads, value_dim = _require_rank("v", v, 4, "[B, T, HV, V]" if grouped_values else "[B, T, H, V]")
    if (vb, vt) != (batch, seq_len):
        raise ShapeError(f"v: expected leading dims [B, T] = {(batch, seq_len)} (as q), got {(vb, vt)}")
    if grouped_values:
        if num_value_heads % num_heads:
            raise ShapeError(
                f"v: expected the value-head count HV to be a multiple of H = {num_heads}, got HV = {num_value_heads}"
            )
    elif num_value_heads != num_heads:
        raise ShapeError(f"v: expected H = {num_heads} heads (as q), got {num_value_heads}")
    for name in ("k", "v"):
        if args[name].dtype != q.dtype:
            raise DTypeError(f"{name}: expected dtype {q.dtype} (same as q), got {args[name].dtype}")
    return batch, seq_len, num_heads, num_value_heads, key_dim, value_dim


def _validate_common(
    op: str, args: dict[str, Any], batch: int, seq_len: int, state_heads: int, key_dim: int, value_dim: int
) -> int | None:
    num_sequences = None
    if args["cu_seqlens"] is not None:
        args["cu_seqlens"], num_sequences = check_cu_seqlens(args["cu_seqlens"], batch, seq_len)
    if args["initial_state"] is not None:
        n = num_sequences if num_sequences is not None else batch
        _check_state(args["initial_state"], (n, state_heads, key_dim, value_dim))
    args["output_final_state"] = _require_bool("output_final_state", args["output_final_state"])
    args["chunk_size"] = _chunk_size(args["chunk_size"])
    args["scale"] = resolve_scale(args["scale"], key_dim)
    return num_sequences


def _check_gate(name: str, x: Any, expected: tuple[int, ...], layout: str) -> None:
    _require_shape(name, x, expected, layout)
    _require_float(name, x)


def _attention_call(op, args, dims, num_sequences, gates, backend, interpret, options=()) -> Call:
    batch, seq_len, num_heads, num_value_heads, key_dim, value_dim = dims
    return Call(
        op=op,
        batch=batch,
        seq_len=seq_len,
        num_heads=num_heads,
        num_value_heads=num_value_heads,
        key_dim=key_dim,
        value_dim=value_dim,
        dtype=str(args["q"].dtype),
        gates=frozenset(gates),
        has_initial_state=args["initial_state"] is not None,
        output_final_state=args["output_final_state"],
        num_sequences=num_sequences,
        chunk_size=args["chunk_size"],
        backend=backend,
        interpret=interpret,
        options=tuple(options),
    )


def _validate_simple_gla(args, backend, interpret):
    dims = _validate_qkv("simple_gla", args, grouped_values=False)
    batch, seq_len, num_heads, _, key_dim, value_dim = dims
    gates = []
    if args["g"] is not None:
        _check_gate("g", args["g"], (batch, seq_len, num_heads), "[B, T, H]")
        gates.append("g")
    if args["g_gamma"] is not None:
        _check_gate("g_gamma", args["g_gamma"], (num_heads,), "[H]")
        gates.append("g_gamma")
    num_sequences = _validate_common("simple_gla", args, batch, seq_len, num_heads, key_dim, value_dim)
    return _attention_call("simple_gla", args, dims, num_sequences, gates, backend, interpret)


def _validate_gla(args, backend, interpret):
    dims = _validate_qkv("gla", args, grouped_values=False)
    batch, seq_len, num_heads, _, key_dim, value_dim = dims
    if args["gk"] is None:
        raise InvalidArgumentError(
            "gk: required for op 'gla' (per-key log decay [B, T, H, K]); for a scalar or no decay use 'simple_gla'"
        )
    _check_gate("gk", args["gk"], (batch, seq_len, num_heads, key_dim), "[B, T, H, K]")
    num_sequences = _validate_common("gla", args, batch, seq_len, num_heads, key_dim, value_dim)
    return _attention_call("gla", args, dims, num_sequences, ["gk"], backend, interpret)


def _validate_lower_bound(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"lower_bound: expected a finite negative number or None, got {value!r}")
    bound = float(value)
    if not math.isfinite(bound) or bound >= 0:
        raise InvalidArgumentError(f"lower_bound: expected a finite negative number or None, got {value!r}")
    return bound


def _validate_gate_params(op: str, args: dict[str, Any], num_value_heads: int, key_dim: int) -> None:
    """Checks A_log [HV] (required), dt_bias [HV*K] (optional) and lower_bound."""
    if args["A_log"] is None:
        raise InvalidArgumentError(
            "A_log: required [HV] array when the gate is computed in the kernel"
            + (" (use_gate_in_kernel=True)" if op == "kda" else "")
        )
    _check_gate("A_log", args["A_log"], (num_value_heads,), "[HV]")
    if args["dt_bias"] is not None:
        _check_gate("dt_bias", args["dt_bias"], (num_value_heads * key_dim,), "[HV * K]")
    args["lower_bound"] = _validate_lower_bound(args["lower_bound"])


def _validate_kda(args, backend, interpret):
    dims = _validate_qkv("kda", args, grouped_values=True)
    batch, seq_len, _, num_value_heads, key_dim, value_dim = dims
    for flag in ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel"):
        args[flag] = _require_bool(flag, args[flag])
    if args["g"] is None:
        raise InvalidArgumentError("g: required for op 'kda' (per-key log decay, or raw gate input, [B, T, HV, K])")
    _check_gate("g", args["g"], (batch, seq_len, num_value_heads, key_dim), "[B, T, HV, K]")
    if args["beta"] is None:
        raise InvalidArgumentError("beta: required for op 'kda' (delta-rule write strength [B, T, HV])")
    _check_gate("beta", args["beta"], (batch, seq_len, num_value_heads), "[B, T, HV]")
    if args["use_gate_in_kernel"]:
        _validate_gate_params("kda", args, num_value_heads, key_dim)
    else:
        for name in ("A_log", "dt_bias", "lower_bound"):
            if args[name] is not None:
                raise InvalidArgumentError(
                    f"{name}: only used when use_gate_in_kernel=True, got {describe(args[name])} "
                    "with use_gate_in_kernel=False (it would be ignored)"
                )
    num_sequences = _validate_common("kda", args, batch, seq_len, num_value_heads, key_dim, value_dim)
    options = [
        ("use_qk_l2norm_in_kernel", args["use_qk_l2norm_in_kernel"]),
        ("use_gate_in_kernel", args["use_gate_in_kernel"]),
        ("use_beta_sigmoid_in_kernel", args["use_beta_sigmoid_in_kernel"]),
        ("has_dt_bias", args["dt_bias"] is not None),
        ("has_lower_bound", args["lower_bound"] is not None),
    ]
    return _attention_call("kda", args, dims, num_sequences, ["g"], backend, interpret, options)


def _validate_kda_gate(args, backend, interpret):
    g = args["g"]
    batch, seq_len, num_value_heads, key_dim = _require_rank("g", g, 4, "[B, T, HV, K]")
    _require_float("g", g)
    _validate_gate_params("kda_gate", args, num_value_heads, key_dim)
    if args["output_dtype"] is None:  # float32, as FLA's; float64 inputs stay float64
        args["output_dtype"] = jnp.float64 if g.dtype == jnp.float64 else jnp.float32
    try:
        output_dtype = jnp.dtype(args["output_dtype"])
    except TypeError as error:
        raise DTypeError(f"output_dtype: expected a floating dtype, got {args['output_dtype']!r}") from error
    if not jnp.issubdtype(output_dtype, jnp.floating):
        raise DTypeError(f"output_dtype: expected a floating dtype, got {output_dtype}")
    args["output_dtype"] = output_dtype
    return Call(
        op="kda_gate",
        batch=batch,
        seq_len=seq_len,
        num_heads=num_value_heads,
        num_value_heads=num_value_heads,
        key_dim=key_dim,
        value_dim=None,
        dtype=str(g.dtype),
        gates=frozenset({"g"}),
        chunk_size=None,
        backend=backend,
        interpret=interpret,
        options=(("has_dt_bias", args["dt_bias"] is not None), ("has_lower_bound", args["lower_bound"] is not None)),
    )


_VALIDATORS = {
    "simple_gla": _validate_simple_gla,
    "gla": _validate_gla,
    "kda": _validate_kda,
    "kda_gate": _validate_kda_gate,
}


def validate(
    op: str, arrays: tuple, kwargs: Mapping[str, Any], *, backend: str, interpret: bool
) -> tuple[Call, dict[str, Any]]:
    """Validates one request.

    Args:
      op: the op name.
      arrays: positional arrays (q, k, v; or g for kda_gate).
      kwargs: keyword arguments by FLA's names (aliases allowed, see KEYWORD_ALIASES).
      backend: the backend the call runs on.
      interpret: the default interpret mode when the call does not say.

    Returns:
      `(call, arguments)`: the static `Call` and every argument of the op by name,
      normalized (scale a float, chunk_size an int, cu_seqlens int32, interpret a bool).
    """
    args = bind_arguments(op, arrays, kwargs)
    args["interpret"] = _interpret(args["interpret"], interpret)
    call = _VALIDATORS[op](args, backend, args["interpret"])
    return call, args
