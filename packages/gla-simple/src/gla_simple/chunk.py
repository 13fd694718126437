"""The `chunk` implementations of simple_gla and gla: the shared Pallas TPU chunk kernels of
`gla_core.chunk`, fixed-length and varlen, forward and backward.

TPU only; off TPU they run in TPU interpret mode when the call asks for it
(`interpret=True`, `GLA_INTERPRET=1` or `gla_core.use(interpret=True)`).
"""

from __future__ import annotations

import gla_core
from gla_core.kit import (
    ANCHOR_RANGE_OPTION,
    BLOCK_SIZE_OPTIONS,
    KERNEL_CHUNK_OPTION,
    block_sizes_of,
    chunk_gated_attention,
    kernel_chunk_of,
    unsupported_dtype_reason,
)
from gla_simple.registration import for_both_ops

IMPLEMENTATION = "chunk"

PRIORITY = 100
BACKENDS = frozenset({"tpu"})
OPTIONS = (*BLOCK_SIZE_OPTIONS, ANCHOR_RANGE_OPTION, KERNEL_CHUNK_OPTION)


def gates_of(args) -> dict:
    """The gate arguments of a simple_gla (g, g_gamma) or gla (gk) arguments record."""
    return {name: getattr(args, name) for name in ("g", "g_gamma", "gk") if hasattr(args, name)}


def run(args):
    """simple_gla or gla on the Pallas chunk kernels, on the call's validated arguments record (the
    kernels' chunk: the `kernel_chunk` option when set, else the call's `chunk_size`)."""
    return chunk_gated_attention(
        args.q,
        args.k,
        args.v,
        **gates_of(args),
        scale=args.scale,
        initial_state=args.initial_state,
        output_final_state=args.output_final_state,
        cu_seqlens=args.cu_seqlens,
        chunk_size=kernel_chunk_of(args.options, args.chunk_size),
        interpret=args.interpret,
        block_sizes=block_sizes_of(args.options),
        anchor_range=args.options.get("anchor_range"),
    )


def supports(call: gla_core.Call) -> str | None:
    """Every call except float64 inputs, which Mosaic cannot compute in."""
    return unsupported_dtype_reason(call.dtype)


def implementations() -> list[gla_core.Implementation]:
    descriptions = {
        "simple_gla": "Pallas TPU chunk kernels (fixed + varlen), VMEM-carried state, hand-written backward",
        "gla": "Pallas TPU chunk kernels with per-key decay (fixed + varlen), hand-written backward",
    }
    return for_both_ops(
        run,
        descriptions,
        name=IMPLEMENTATION,
        priority=PRIORITY,
        backends=BACKENDS,
        supports=supports,
        interpretable=True,
        options=OPTIONS,
    )
