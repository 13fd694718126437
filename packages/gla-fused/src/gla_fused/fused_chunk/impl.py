"""The `fused_chunk` implementation of simple_gla: its jitted entry, `supports` and record."""

from __future__ import annotations

import functools

import jax

import gla_core
from gla_core.errors import InvalidArgumentError
from gla_core.tpu import unsupported_dtype_reason
from gla_fused.fused_chunk.pipeline import IMPLEMENTATION, fused_chunk_attention
from gla_fused.fused_chunk.steps import DEFAULT_NUM_STEPS

NAME = IMPLEMENTATION
PRIORITY = 110
BACKENDS = frozenset({"tpu"})
STATIC_ARGUMENTS = ("scale", "output_final_state", "chunk_size", "interpret", "num_steps")

VARLEN_REASON = (
    "packed varlen input (cu_seqlens): several sequences can start inside one multi-chunk grid iteration, "
    "so per-sequence initial/final states cannot be block-indexed; use impl='chunk'"
)


@functools.partial(jax.jit, static_argnames=STATIC_ARGUMENTS)
def simple_gla(
    q,
    k,
    v,
    *,
    g,
    g_gamma,
    scale,
    initial_state,
    output_final_state,
    cu_seqlens,
    chunk_size,
    interpret,
    num_steps: int = DEFAULT_NUM_STEPS,
):
    """simple_gla on the fused kernels; arguments as normalized by `gla_core.dispatch`, plus
    `num_steps`, the most chunks one grid iteration handles (see `fused_chunk_attention`)."""
    if cu_seqlens is not None:
        raise InvalidArgumentError(f"cu_seqlens: the {NAME} implementation does not take {VARLEN_REASON}")
    return fused_chunk_attention(
        q,
        k,
        v,
        g=g,
        g_gamma=g_gamma,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
        num_steps=num_steps,
        interpret=interpret,
    )


def supports(call: gla_core.Call) -> str | None:
    """Every fixed-length call in bfloat16, float16 or float32."""
    if call.varlen:
        return VARLEN_REASON
    return unsupported_dtype_reason(call.dtype)


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
                "Pallas TPU fused forward (state in VMEM, num_steps chunks per grid step), split backward; fixed length"
            ),
        )
    ]
