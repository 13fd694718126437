"""The `xla` implementations of simple_gla and gla: chunked, plain `jnp`, every backend.

The CPU/GPU default and the baseline every Pallas kernel is compared with. The math is in
`gla_simple.chunked` (one core for both ops: a scalar decay is a [.., 1] gate broadcast over
the keys, a per-key decay a [.., K] gate); the chunk size is the call's `chunk_size`.
"""

from __future__ import annotations

import functools

import jax

import gla_core
from gla_simple import frontend
from gla_simple.chunked import chunked_core

PRIORITY = 50
BACKENDS = frozenset({"cpu", "gpu", "tpu"})


@functools.partial(jax.jit, static_argnames=frontend.STATIC_ARGUMENTS)
def simple_gla(q, k, v, *, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, chunk_size, interpret):
    """simple_gla on the chunked XLA core; arguments as normalized by `gla_core.dispatch`."""
    del interpret
    gate = frontend.simple_gla_gate(q, g, g_gamma)
    return frontend.run(
        chunked_core,
        q,
        k,
        v,
        gate,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )


@functools.partial(jax.jit, static_argnames=frontend.STATIC_ARGUMENTS)
def gla(q, k, v, *, gk, scale, initial_state, output_final_state, cu_seqlens, chunk_size, interpret):
    """gla on the chunked XLA core; arguments as normalized by `gla_core.dispatch`."""
    del interpret
    return frontend.run(
        chunked_core,
        q,
        k,
        v,
        gk,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )


def implementations() -> list[gla_core.Implementation]:
    common = dict(name="xla", priority=PRIORITY, backends=BACKENDS, package="gla-simple")
    return [
        gla_core.Implementation(
            op="simple_gla",
            fn=simple_gla,
            description="chunked plain-XLA GEMMs (f32), hand-written backward; the CPU/GPU default",
            **common,
        ),
        gla_core.Implementation(
            op="gla",
            fn=gla,
            description="chunked plain-XLA GEMMs with sub-chunked per-key decay (f32), hand-written backward",
            **common,
        ),
    ]
