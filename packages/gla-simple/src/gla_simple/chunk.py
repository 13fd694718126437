"""The `chunk` implementations of simple_gla and gla: the shared Pallas TPU chunk kernels of
`gla_core.chunk`, fixed-length and varlen, forward and backward.

TPU only; off TPU they run in TPU interpret mode when the call asks for it
(`interpret=True`, `GLA_INTERPRET=1` or `gla_core.use(interpret=True)`).
"""

from __future__ import annotations

import functools

import jax

import gla_core
from gla_core.chunk import chunk_gated_attention
from gla_core.chunk.pipeline import IMPLEMENTATION
from gla_core.tpu import unsupported_dtype_reason

PRIORITY = 100
BACKENDS = frozenset({"tpu"})
STATIC_ARGUMENTS = ("scale", "output_final_state", "chunk_size", "interpret")


@functools.partial(jax.jit, static_argnames=STATIC_ARGUMENTS)
def simple_gla(q, k, v, *, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, chunk_size, interpret):
    """simple_gla on the Pallas chunk kernels; arguments as normalized by `gla_core.dispatch`."""
    return chunk_gated_attention(
        q,
        k,
        v,
        g=g,
        g_gamma=g_gamma,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
        interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=STATIC_ARGUMENTS)
def gla(q, k, v, *, gk, scale, initial_state, output_final_state, cu_seqlens, chunk_size, interpret):
    """gla on the Pallas chunk kernels; arguments as normalized by `gla_core.dispatch`."""
    return chunk_gated_attention(
        q,
        k,
        v,
        gk=gk,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
        interpret=interpret,
    )


def supports(call: gla_core.Call) -> str | None:
    """Every call except float64 inputs, which Mosaic cannot compute in."""
    return unsupported_dtype_reason(call.dtype)


def implementations() -> list[gla_core.Implementation]:
    common = dict(
        name=IMPLEMENTATION,
        priority=PRIORITY,
        backends=BACKENDS,
        package="gla-simple",
        supports=supports,
        interpretable=True,
    )
    return [
        gla_core.Implementation(
            op="simple_gla",
            fn=simple_gla,
            description="Pallas TPU chunk kernels (fixed + varlen), VMEM-carried state, hand-written backward",
            **common,
        ),
        gla_core.Implementation(
            op="gla",
            fn=gla,
            description="Pallas TPU chunk kernels with per-key decay (fixed + varlen), hand-written backward",
            **common,
        ),
    ]
