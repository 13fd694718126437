"""How many tokens one grid step of the fused kernels takes, and their chunk."""

from __future__ import annotations

from gla_core.kit import CHUNK_SIZES

# The kernels' chunks: the op's chunk sizes and 256, which fills v6e's 256-wide MXU. v6e static
# estimate, B=2 T=4096 H=16 K=V=128 bf16 (cycles; forward alone, then the training step's forward
# + backward): chunk 64 (128 tokens per step) 524 k; chunk 128 (128 tokens) 360 k, 347 k + 705 k;
# chunk 256 (256 tokens) 285 k, 267 k + 615 k; chunk 256 (512 tokens) 249 k + 607 k but 59 MiB of
# VMEM. The per-chip table (`gla_core.tuning`) sets 256 on v6e; these defaults (calls traced for no
# TPU chip, e.g. interpret mode) keep the cheaper chunk 128.
KERNEL_CHUNKS = (*CHUNK_SIZES, 256)
DEFAULT_KERNEL_CHUNK = 128
DEFAULT_BLOCK_TOKENS = 128


def largest_divisor_at_most(count: int, bound: int) -> int:
    """The largest divisor of `count` that is <= `bound` (e.g. 6 chunks with bound 4 gives 3; a
    prime count larger than the bound gives 1)."""
    if count < 1:
        raise ValueError(f"count: expected a positive number of chunks, got {count}")
    if bound < 1:
        raise ValueError(f"bound: expected a positive number of chunks per grid step, got {bound}")
    return next(steps for steps in range(min(bound, count), 0, -1) if count % steps == 0)


def block_tokens_for(seq_len: int, chunk: int, block_tokens: int) -> int:
    """Tokens per grid step for a sequence of `seq_len`: the largest multiple of `chunk` that is
    <= max(block_tokens, chunk) and divides T rounded up to the chunk."""
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"kernel_chunk: expected a power of two, got {chunk}")
    chunks = max(1, -(-seq_len // chunk))
    return chunk * largest_divisor_at_most(chunks, max(1, block_tokens // chunk))
