"""The `fused_chunk` implementation of simple_gla: its jitted entry, `supports` and record."""

from __future__ import annotations

import gla_core
from gla_core.kit import Option, positive_int, unsupported_dtype_reason
from gla_fused.fused_chunk.pipeline import IMPLEMENTATION, fused_chunk_attention
from gla_fused.fused_chunk.steps import DEFAULT_BLOCK_TOKENS, DEFAULT_KERNEL_CHUNK, KERNEL_CHUNKS
from gla_fused.registration import fused_implementation

NAME = IMPLEMENTATION
PRIORITY = 110
BACKENDS = frozenset({"tpu"})
OPTIONS = (
    Option(
        "kernel_chunk",
        DEFAULT_KERNEL_CHUNK,
        positive_int("kernel_chunk", KERNEL_CHUNKS),
        "the kernels' chunk",
        candidates=(64, 128, 256),
    ),
    Option(
        "block_tokens",
        DEFAULT_BLOCK_TOKENS,
        positive_int("block_tokens"),
        "the most tokens per grid step",
        candidates=(128, 256, 512),
    ),
)


def run(args):
    """simple_gla on the fused kernels, on the call's validated arguments record (options: the
    kernels' chunk and tokens per grid step; the op's `chunk_size` does not apply, see
    `pipeline.fused_chunk_attention`)."""
    return fused_chunk_attention(
        args.q,
        args.k,
        args.v,
        g=args.g,
        g_gamma=args.g_gamma,
        scale=args.scale,
        initial_state=args.initial_state,
        output_final_state=args.output_final_state,
        kernel_chunk=args.options["kernel_chunk"],
        block_tokens=args.options["block_tokens"],
        cu_seqlens=args.cu_seqlens,
        interpret=args.interpret,
    )


def supports(call: gla_core.Call) -> str | None:
    """Every call (fixed length or packed varlen) in bfloat16, float16 or float32."""
    return unsupported_dtype_reason(call.dtype)


def implementations() -> list[gla_core.Implementation]:
    description = (
        "Pallas TPU fused forward and backward on the op's own layout (all heads of a block of tokens "
        "per grid step, state in VMEM); fixed length and packed varlen"
    )
    return [fused_implementation(NAME, run, PRIORITY, description, supports=supports, options=OPTIONS)]
