"""The `fused_g_gamma` implementation of simple_gla: calls whose only gate is `g_gamma`.

One Pallas TPU kernel for the forward and one for the backward (see `forward`, `backward`),
with the gates computed analytically from g_gamma inside them. TPU only; off TPU it runs in
TPU interpret mode when the call asks for it.
"""

from __future__ import annotations

import functools

import jax

import gla_core
from gla_core import errors
from gla_core.tpu import unsupported_dtype_reason
from gla_fused.g_gamma.pipeline import IMPLEMENTATION, fused_g_gamma_attention

NAME = IMPLEMENTATION
PRIORITY = 120
BACKENDS = frozenset({"tpu"})
STATIC_ARGUMENTS = ("scale", "output_final_state", "chunk_size", "interpret")


@functools.partial(jax.jit, static_argnames=STATIC_ARGUMENTS)
def simple_gla(q, k, v, *, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, chunk_size, interpret):
    """simple_gla on the fused g_gamma kernels; arguments as normalized by `gla_core.dispatch`.

    Only calls `supports` accepts reach it: g_gamma given, no g, no cu_seqlens.
    """
    if g is not None or g_gamma is None:
        raise errors.InvalidArgumentError(f"g_gamma: {NAME} needs g_gamma [H] as the only gate (got g={g is not None})")
    if cu_seqlens is not None:
        raise errors.InvalidArgumentError(f"cu_seqlens: {NAME} handles fixed-length batches only; use impl='chunk'")
    return fused_g_gamma_attention(
        q,
        k,
        v,
        g_gamma,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
        interpret=interpret,
    )


def _describe_gates(gates) -> str:
    return "{" + ", ".join(repr(g) for g in sorted(gates)) + "}" if gates else "no gate"


def supports(call: gla_core.Call) -> str | None:
    """Accepts fixed-length bfloat16/float32 (or float16) calls whose only gate is g_gamma."""
    if call.gates != {"g_gamma"}:
        return f"needs g_gamma as the only gate; this call has {_describe_gates(call.gates)}: use fused_chunk or chunk"
    dtype_reason = unsupported_dtype_reason(call.dtype)
    if dtype_reason is not None:
        return dtype_reason
    if call.varlen:
        return (
            f"packed varlen input (cu_seqlens, {call.num_sequences} sequences): {NAME} handles "
            "fixed-length batches only; use impl='chunk'"
        )
    return None


def implementations() -> list[gla_core.Implementation]:
    return [
        gla_core.Implementation(
            op="simple_gla",
            name=NAME,
            fn=simple_gla,
            priority=PRIORITY,
            backends=BACKENDS,
            package="gla-fused",
            supports=supports,
            interpretable=True,
            description=(
                "g_gamma-only simple_gla: one fused Pallas TPU kernel forward, one backward, "
                "analytic in-kernel decays, exact d g_gamma"
            ),
        )
    ]
