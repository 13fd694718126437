"""The ops gla-core defines: `simple_gla` (a scalar decay per head and step) and `gla` (a per-key decay).

Both are implemented by other packages (gla-simple, gla-fused; gla-ref's `reference`); gla-core
defines them because several packages serve them. gla-kda defines `kda` and `kda_gate` itself.
"""

from __future__ import annotations

import jax.numpy as jnp

from gla_core.errors import InvalidArgumentError
from gla_core.hookspecs import hookimpl
from gla_core.ops import ContextParallelSpec, OpSpec, attention_spec
from gla_core.validation import attention_call, check_gate, validate_common, validate_qkv


def _validate_simple_gla(args, backend, interpret):
    dims = validate_qkv("simple_gla", args, grouped_values=False)
    batch, seq_len, num_heads, _, key_dim, value_dim = dims
    gates = []
    if args["g"] is not None:
        check_gate("g", args["g"], (batch, seq_len, num_heads), "[B, T, H]")
        gates.append("g")
    if args["g_gamma"] is not None:
        check_gate("g_gamma", args["g_gamma"], (num_heads,), "[H]")
        gates.append("g_gamma")
    num_sequences = validate_common("simple_gla", args, batch, seq_len, num_heads, key_dim, value_dim)
    return attention_call("simple_gla", args, dims, num_sequences, gates, backend, interpret)


def _validate_gla(args, backend, interpret):
    dims = validate_qkv("gla", args, grouped_values=False)
    batch, seq_len, num_heads, _, key_dim, value_dim = dims
    if args["gk"] is None:
        raise InvalidArgumentError(
            "gk: required for op 'gla' (per-key log decay [B, T, H, K]); for a scalar or no decay use 'simple_gla'"
        )
    check_gate("gk", args["gk"], (batch, seq_len, num_heads, key_dim), "[B, T, H, K]")
    num_sequences = validate_common("gla", args, batch, seq_len, num_heads, key_dim, value_dim)
    return attention_call("gla", args, dims, num_sequences, ["gk"], backend, interpret)


def _simple_gla_log_decay(args):
    """Per-token log decay [B, T, H, 1] of simple_gla: g + g_gamma (either may be absent)."""
    batch, seq_len, num_heads, _ = args["q"].shape
    decay = jnp.zeros((batch, seq_len, num_heads, 1), jnp.float32)
    if args["g"] is not None:
        decay = decay + args["g"].astype(jnp.float32)[..., None]
    if args["g_gamma"] is not None:
        decay = decay + args["g_gamma"].astype(jnp.float32)[:, None]
    return decay


def _gla_log_decay(args):
    """Per-token, per-key log decay [B, T, H, K] of gla: gk."""
    return args["gk"].astype(jnp.float32)


SIMPLE_GLA = attention_spec(
    "simple_gla",
    _validate_simple_gla,
    "gated linear attention with a scalar decay per head and step (g [B,T,H], g_gamma [H])",
    providers=("gla-simple", "gla-fused"),
    keywords=dict(g=None, g_gamma=None),
    context_parallel=ContextParallelSpec(
        token_arrays=("g",), head_arrays=("g_gamma",), log_decay=_simple_gla_log_decay
    ),
)
GLA = attention_spec(
    "gla",
    _validate_gla,
    "gated linear attention with a per-key decay gk [B,T,H,K]",
    providers=("gla-simple",),
    keywords=dict(gk=None),
    aliases={"g": "gk"},  # FLA's chunk_gla calls the per-key gate `g`; fused_recurrent_gla calls it `gk`
    context_parallel=ContextParallelSpec(token_arrays=("gk",), log_decay=_gla_log_decay),
)


@hookimpl
def gla_ops() -> list[OpSpec]:
    return [SIMPLE_GLA, GLA]
