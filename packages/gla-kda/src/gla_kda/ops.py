"""The ops gla-kda defines: `kda` (Kimi Delta Attention) and `kda_gate` (its gate alone), with their
validators. Registered through the `gla_ops` hook of `gla_kda.plugin`."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax.numpy as jnp
import numpy as np

from gla_core.errors import DTypeError, InvalidArgumentError, describe
from gla_core.kit import (
    Call,
    ContextParallelSpec,
    OpSpec,
    attention_call,
    attention_spec,
    check_gate,
    require_bool,
    require_float,
    require_rank,
    validate_common,
    validate_qkv,
)


def validate_lower_bound(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"lower_bound: expected a finite negative number or None, got {value!r}")
    bound = float(value)
    if not math.isfinite(bound) or bound >= 0:
        raise InvalidArgumentError(f"lower_bound: expected a finite negative number or None, got {value!r}")
    return bound


def validate_gate_params(op: str, args: dict[str, Any], num_value_heads: int, key_dim: int) -> None:
    """Checks A_log [HV] or FLA's [1, 1, HV, 1] (normalized to [HV]; may be None with a lower_bound:
    the rate exp(A_log) is then 1), dt_bias [HV*K] (optional) and lower_bound."""
    args["lower_bound"] = validate_lower_bound(args["lower_bound"])
    A_log = args["A_log"]
    if A_log is None:
        if args["lower_bound"] is None:
            raise InvalidArgumentError(
                "A_log: required [HV] array when the gate is computed in the kernel"
                + (" (use_gate_in_kernel=True)" if op == "kda" else "")
                + " without a lower_bound, got None"
            )
    else:
        if tuple(getattr(A_log, "shape", ())) == (1, 1, num_value_heads, 1):  # FLA's layout
            A_log = args["A_log"] = A_log.reshape(num_value_heads)
        check_gate("A_log", A_log, (num_value_heads,), "[HV] (or [1, 1, HV, 1])")
    if args["dt_bias"] is not None:
        check_gate("dt_bias", args["dt_bias"], (num_value_heads * key_dim,), "[HV * K]")


# kda's flags, and FLA's newer ones (in Call.options only when True).
_FLAGS = ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel")
_FLA_FLAGS = ("allow_neg_eigval", "safe_gate", "disable_recompute", "return_intermediate_states")


def _validate_kda(args, backend, interpret):
    dims = validate_qkv("kda", args, grouped_values=True)
    batch, seq_len, _, num_value_heads, key_dim, value_dim = dims
    for flag in (*_FLAGS, *_FLA_FLAGS):
        args[flag] = require_bool(flag, args[flag])
    if args["g"] is None:
        raise InvalidArgumentError("g: required for op 'kda' (per-key log decay, or raw gate input, [B, T, HV, K])")
    check_gate("g", args["g"], (batch, seq_len, num_value_heads, key_dim), "[B, T, HV, K]")
    if args["beta"] is None:
        raise InvalidArgumentError("beta: required for op 'kda' (delta-rule write strength [B, T, HV])")
    check_gate("beta", args["beta"], (batch, seq_len, num_value_heads), "[B, T, HV]")
    if args["use_gate_in_kernel"]:
        validate_gate_params("kda", args, num_value_heads, key_dim)
    else:
        for name in ("A_log", "dt_bias"):
            if args[name] is not None:
                raise InvalidArgumentError(
                    f"{name}: only used when use_gate_in_kernel=True, got {describe(args[name])} "
                    "with use_gate_in_kernel=False (it would be ignored)"
                )
        # FLA's safe-gate calls pass the bound of a precomputed g: it states g >= lower_bound (FLA's
        # kernels rely on it; gla's compute the recurrence exactly for any g)
        args["lower_bound"] = validate_lower_bound(args["lower_bound"])
    _validate_fla_flags(args)
    num_sequences = validate_common("kda", args, batch, seq_len, num_value_heads, key_dim, value_dim)
    options = [
        ("use_qk_l2norm_in_kernel", args["use_qk_l2norm_in_kernel"]),
        ("use_gate_in_kernel", args["use_gate_in_kernel"]),
        ("use_beta_sigmoid_in_kernel", args["use_beta_sigmoid_in_kernel"]),
        ("has_dt_bias", args["dt_bias"] is not None),
        ("has_lower_bound", args["lower_bound"] is not None),
        *((flag, True) for flag in _FLA_FLAGS if args[flag]),
    ]
    intermediate = args["return_intermediate_states"]
    call = attention_call(
        "kda", args, dims, num_sequences, ["g"], backend, interpret, options, keep_host_boundaries=intermediate
    )
    if intermediate and num_sequences is not None and args["cu_seqlens_cpu"] is None:
        raise InvalidArgumentError(
            "return_intermediate_states: with packed sequences the number of chunks depends on the "
            "boundaries; pass cu_seqlens_cpu (the host copy of cu_seqlens) or a concrete cu_seqlens"
        )
    return call


def _validate_fla_flags(args) -> None:
    """FLA's rules for its kda flags (each raises naming the flag)."""
    if args["allow_neg_eigval"] and not args["use_beta_sigmoid_in_kernel"]:
        raise InvalidArgumentError(
            "allow_neg_eigval: needs use_beta_sigmoid_in_kernel=True (beta = 2 * sigmoid(beta), in (0, 2)), "
            "got use_beta_sigmoid_in_kernel=False"
        )
    if args["safe_gate"] and args["use_gate_in_kernel"]:
        bound = args["lower_bound"]
        if bound is None or not -5.0 <= bound < 0.0:
            raise InvalidArgumentError(
                f"lower_bound: safe_gate=True with use_gate_in_kernel=True needs a lower_bound in [-5, 0), got {bound}"
            )
    if args["return_intermediate_states"] and args["ssm_state_indices"] is not None:
        raise InvalidArgumentError(
            "return_intermediate_states: not with a state pool (ssm_state_indices); the decode path returns the "
            "updated pool, or every token's state with inplace_final_state=False"
        )
    if args["return_intermediate_states"] and args["disable_recompute"]:
        raise InvalidArgumentError(
            "return_intermediate_states: needs disable_recompute=False (as in FLA), got disable_recompute=True"
        )


def _validate_kda_gate(args, backend, interpret):
    g = args["g"]
    batch, seq_len, num_value_heads, key_dim = require_rank("g", g, 4, "[B, T, HV, K]")
    require_float("g", g)
    validate_gate_params("kda_gate", args, num_value_heads, key_dim)
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


KDA = attention_spec(
    "kda",
    _validate_kda,
    "Kimi Delta Attention: delta rule with per-key decay g [B,T,HV,K] and beta [B,T,HV]",
    providers=("gla-kda",),
    keywords=dict(
        g=None,
        beta=None,
        use_qk_l2norm_in_kernel=False,
        use_gate_in_kernel=False,
        A_log=None,
        dt_bias=None,
        lower_bound=None,
        use_beta_sigmoid_in_kernel=False,
        allow_neg_eigval=False,
        safe_gate=False,
        disable_recompute=False,
        return_intermediate_states=False,
    ),
    static=frozenset(
        {"use_qk_l2norm_in_kernel", "use_gate_in_kernel", "lower_bound", "use_beta_sigmoid_in_kernel", *_FLA_FLAGS}
    ),
    # the delta rule mixes the key rows of the state: a dense [K, K] transition per shard
    context_parallel=ContextParallelSpec(token_arrays=("g", "beta"), head_arrays=("A_log", "dt_bias")),
)
KDA_GATE = OpSpec(
    name="kda_gate",
    arrays=("g",),
    keywords=dict(A_log=None, dt_bias=None, lower_bound=None, output_dtype=None),
    static=frozenset({"lower_bound", "output_dtype"}),
    validate=_validate_kda_gate,
    summary="KDA log decay -exp(A_log)*softplus(g+dt_bias), or lower_bound*sigmoid(exp(A_log)*(g+dt_bias))",
    providers=("gla-kda",),
)
