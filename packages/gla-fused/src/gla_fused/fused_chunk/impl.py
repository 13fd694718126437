"""The `fused_chunk` implementation of simple_gla: its jitted entry, `supports` and record."""

from __future__ import annotations

import gla_core
from gla_core.errors import InvalidArgumentError
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

VARLEN_REASON = (
    "packed varlen input (cu_seqlens): several sequences can start inside one multi-chunk grid iteration, "
    "so per-sequence initial/final states cannot be block-indexed; use impl='chunk'"
)


def run(args):
    """simple_gla on the fused kernels, on the call's validated arguments record (options: the
    kernels' chunk and tokens per grid step; the op's `chunk_size` does not apply, see
    `pipeline.fused_chunk_attention`)."""
    if args.cu_seqlens is not None:
        raise InvalidArgumentError(f"cu_seqlens: the {NAME} implementation does not take {VARLEN_REASON}")
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
        interpret=args.interpret,
    )


def supports(call: gla_core.Call) -> str | None:
    """Every fixed-length call in bfloat16, float16 or float32."""
    if call.varlen:
        return VARLEN_REASON
    return unsupported_dtype_reason(call.dtype)


def implementations() -> list[gla_core.Implementation]:
    description = (
        "Pallas TPU fused forward and backward on the op's own layout (all heads of a block of tokens "
        "per grid step, state in VMEM); fixed length"
    )
    return [fused_implementation(NAME, run, PRIORITY, description, supports=supports, options=OPTIONS)]
