"""Validation of one request: arrays and keywords in, a `Call` and normalized arguments out.

`validate(spec, ...)` binds the arguments to the op's signature (`gla_core.ops.OpSpec`) and runs the
op's own validator; the checks here are the shared building blocks of those validators (public for
plugin authors through `gla_core.kit`). Arguments are checked once, before any implementation sees
them; errors name the argument, the expected and the received shape, dtype or value. Checks on
`cu_seqlens` values run only when the array is concrete, so validation works unchanged under
`jax.jit` with traced boundaries.
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
)
from gla_core.ops import CHUNK_SIZES, OpSpec
from gla_core.records import Call
from gla_core.state_args import state_options, validate_state_arguments


def bind_arguments(spec: OpSpec, arrays: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Binds positional arrays and keywords to the op's full signature.

    Returns every argument of the op by name, defaults filled in, plus `interpret` (None when
    not given). Raises for too many positional arrays, duplicated or unknown keywords and
    missing arrays.
    """
    op, signature = spec.name, spec
    if len(arrays) > len(signature.arrays):
        raise UnknownArgumentError(
            f"{op}: expected at most {len(signature.arrays)} positional arrays "
            f"({', '.join(signature.arrays)}), got {len(arrays)}; pass the others by keyword"
        )
    bound: dict[str, Any] = dict(zip(signature.arrays, arrays, strict=False))
    known = set(signature.arrays) | set(signature.keywords) | {"interpret"}
    for name, value in kwargs.items():
        canonical = spec.aliases.get(name, name)
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


def array_shape(name: str, x: Any) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if shape is None or getattr(x, "dtype", None) is None:
        raise DTypeError(f"{name}: expected an array, got {type(x).__name__}")
    return tuple(int(d) for d in shape)


def require_float(name: str, x: Any) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise DTypeError(f"{name}: expected a floating dtype (bfloat16, float16, float32, float64), got {x.dtype}")


def require_shape(name: str, x: Any, expected: tuple[int, ...], layout: str) -> None:
    got = array_shape(name, x)
    if got != expected:
        if len(got) != len(expected):
            raise ShapeError(f"{name}: expected rank {len(expected)} {layout} = {expected}, got shape {got}")
        raise ShapeError(f"{name}: expected shape {layout} = {expected}, got {got}")


def require_rank(name: str, x: Any, rank: int, layout: str) -> tuple[int, ...]:
    shape = array_shape(name, x)
    if len(shape) != rank:
        raise ShapeError(f"{name}: expected rank {rank} {layout}, got shape {shape}")
    if any(d == 0 for d in shape[2:]):
        raise ShapeError(f"{name}: expected non-empty head and feature dims in {layout}, got shape {shape}")
    return shape


def require_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentError(f"{name}: expected a bool, got {value!r}")
    return bool(value)


def is_concrete(x: Any) -> bool:
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


def normalize_chunk_size(value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or int(value) not in CHUNK_SIZES:
        raise InvalidArgumentError(f"chunk_size: expected one of {CHUNK_SIZES}, got {value!r}")
    return int(value)


def check_cu_seqlens(cu_seqlens: Any, batch: int, seq_len: int) -> tuple[Any, int]:
    """Validates `cu_seqlens` and returns it as int32 with the number of sequences N.

    Structure (rank, dtype, B == 1) is always checked; values (starts at 0, ends at T,
    non-decreasing) only when the array is concrete.
    """
    shape = array_shape("cu_seqlens", cu_seqlens)
    if len(shape) != 1 or shape[0] < 2:
        raise ShapeError(f"cu_seqlens: expected a 1-D array [N+1] with N >= 1, got shape {shape}")
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise DTypeError(f"cu_seqlens: expected an integer dtype (int32), got {cu_seqlens.dtype}")
    if batch != 1:
        raise ShapeError(
            f"cu_seqlens: packed sequences need batch size B == 1 (flatten to [1, sum(T), ...]), got B = {batch}"
        )
    if is_concrete(cu_seqlens):
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


def check_state(initial_state: Any, expected: tuple[int, ...]) -> None:
    require_shape("initial_state", initial_state, expected, "[N, H, K, V]")
    require_float("initial_state", initial_state)


def normalize_interpret(value: Any, default: bool) -> bool:
    if value is None:
        return default
    return require_bool("interpret", value)


# --------------------------------------------------------------------------- per op


def validate_qkv(op: str, args: dict[str, Any], grouped_values: bool) -> tuple[int, int, int, int, int, int]:
    q, k, v = args["q"], args["k"], args["v"]
    batch, seq_len, num_heads, key_dim = require_rank("q", q, 4, "[B, T, H, K]")
    require_float("q", q)
    require_shape("k", k, (batch, seq_len, num_heads, key_dim), "[B, T, H, K] (as q)")
    vb, vt, num_value_heads, value_dim = require_rank("v", v, 4, "[B, T, HV, V]" if grouped_values else "[B, T, H, V]")
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


def validate_common(
    op: str, args: dict[str, Any], batch: int, seq_len: int, state_heads: int, key_dim: int, value_dim: int
) -> int | None:
    num_sequences = None
    if args["cu_seqlens"] is not None:
        args["cu_seqlens"], num_sequences = check_cu_seqlens(args["cu_seqlens"], batch, seq_len)
    # initial_state (or the state pool), state_v_first, cu_seqlens_cpu: see gla_core.state_args
    validate_state_arguments(args, batch, seq_len, state_heads, key_dim, value_dim, num_sequences)
    args["output_final_state"] = require_bool("output_final_state", args["output_final_state"])
    args["chunk_size"] = normalize_chunk_size(args["chunk_size"])
    args["scale"] = resolve_scale(args["scale"], key_dim)
    return num_sequences


def check_gate(name: str, x: Any, expected: tuple[int, ...], layout: str) -> None:
    require_shape(name, x, expected, layout)
    require_float(name, x)


def attention_call(op, args, dims, num_sequences, gates, backend, interpret, options=(), keep_host_boundaries=False):
    """The `Call` of a validated attention op; `options` are the op's own, the state options
    (`state_args.state_options`) are added. `keep_host_boundaries`: a result's shape depends on the
    packed boundaries, so `cu_seqlens_cpu` (or a concrete `cu_seqlens`) is kept in the arguments."""
    batch, seq_len, num_heads, num_value_heads, key_dim, value_dim = dims
    options = (*options, *state_options(args, keep_host_boundaries))
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


def validate(
    spec: OpSpec, arrays: tuple, kwargs: Mapping[str, Any], *, backend: str, interpret: bool
) -> tuple[Call, dict[str, Any]]:
    """Validates one request.

    Args:
      spec: the op.
      arrays: its positional arrays, named by `spec.arrays` (q, k, v for the attention ops).
      kwargs: keyword arguments by FLA's names (or the op's aliases).
      backend: the backend the call runs on.
      interpret: the default interpret mode when the call does not say.

    Returns:
      `(call, arguments)`: the static `Call` and every argument of the op by name,
      normalized (scale a float, chunk_size an int, cu_seqlens int32, interpret a bool).
    """
    args = bind_arguments(spec, arrays, kwargs)
    args["interpret"] = normalize_interpret(args["interpret"], interpret)
    call = spec.validate(args, backend, args["interpret"])
    return call, args
