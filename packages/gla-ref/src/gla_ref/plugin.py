"""Entry point of gla-ref in the `gla` plugin group: the `reference` implementation of every op.

The reference implementations run the token-by-token recurrences of `gla_ref.recurrent`
(priority 0: chosen only when asked for, or when nothing else accepts). They are plain
JAX, so `jax.grad` differentiates them directly. `o` is returned in v's dtype and the final
state in float32 (float64 when the computation is float64); kda_gate returns `output_dtype`.
"""

from __future__ import annotations

import jax.numpy as jnp

from gla_core import Implementation, hookimpl
from gla_ref import recurrent

BACKENDS = frozenset({"cpu", "gpu", "tpu"})
PACKAGE = "gla-ref"


def _attention_result(o, final_state, v):
    """`o` in v's dtype, the state in float32 (float64 if computed in float64)."""
    if final_state is not None:
        final_state = final_state.astype(jnp.promote_types(final_state.dtype, jnp.float32))
    return o.astype(v.dtype), final_state


def reference_simple_gla(
    q, k, v, *, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, chunk_size, interpret
):
    """Dispatch adapter of `recurrent.simple_gla` (chunk_size and interpret are ignored)."""
    o, final_state = recurrent.simple_gla(
        q,
        k,
        v,
        g=g,
        g_gamma=g_gamma,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
    return _attention_result(o, final_state, v)


def reference_gla(q, k, v, *, gk, scale, initial_state, output_final_state, cu_seqlens, chunk_size, interpret):
    """Dispatch adapter of `recurrent.gla` (chunk_size and interpret are ignored)."""
    o, final_state = recurrent.gla(
        q,
        k,
        v,
        gk,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
    return _attention_result(o, final_state, v)


def reference_kda(
    q,
    k,
    v,
    *,
    g,
    beta,
    scale,
    initial_state,
    output_final_state,
    cu_seqlens,
    chunk_size,
    use_qk_l2norm_in_kernel,
    use_gate_in_kernel,
    A_log,
    dt_bias,
    lower_bound,
    use_beta_sigmoid_in_kernel,
    interpret,
):
    """Dispatch adapter of `recurrent.kda` (chunk_size and interpret are ignored)."""
    o, final_state = recurrent.kda(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
    )
    return _attention_result(o, final_state, v)


def reference_kda_gate(g, *, A_log, dt_bias, lower_bound, output_dtype, interpret):
    """Dispatch adapter of `recurrent.kda_gate`, cast to `output_dtype` (interpret is ignored)."""
    return recurrent.kda_gate(g, A_log, dt_bias=dt_bias, lower_bound=lower_bound).astype(output_dtype)


_DESCRIPTIONS = {
    "simple_gla": "token-by-token lax.scan recurrence (oracle; slow, any shape, varlen, h0/ht)",
    "gla": "token-by-token lax.scan recurrence with per-key decay (oracle; slow, any shape, varlen, h0/ht)",
    "kda": "token-by-token lax.scan delta-rule recurrence (oracle; slow, any shape, grouped heads, varlen)",
    "kda_gate": "plain jnp softplus/sigmoid gate (oracle)",
}

_FUNCTIONS = {
    "simple_gla": reference_simple_gla,
    "gla": reference_gla,
    "kda": reference_kda,
    "kda_gate": reference_kda_gate,
}


@hookimpl
def gla_implementations():
    """The `reference` implementation of every op."""
    return [
        Implementation(
            op=op,
            name="reference",
            fn=fn,
            priority=0,
            backends=BACKENDS,
            package=PACKAGE,
            description=_DESCRIPTIONS[op],
        )
        for op, fn in _FUNCTIONS.items()
    ]
