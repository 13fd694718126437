"""How many tokens and chunks one grid iteration of the fused kernels walks."""

from __future__ import annotations

# The forward kernel's chunk and tokens per grid step. v6e static estimate, B=2 T=4096 H=16
# K=V=128 bf16: chunk 128 319.6 k cycles, chunk 64 523.6 k (128 tokens per step).
DEFAULT_KERNEL_CHUNK = 128
DEFAULT_BLOCK_TOKENS = 128

# v6e static estimate, fused_chunk forward, T = 2048, chunk 64: 4 / 8 / 16 chunks per iteration
# 12014 / 8595 / 7539 cycles; 8 keeps VMEM small for wide K and V tiles.
DEFAULT_NUM_STEPS = 8


def effective_num_steps(num_chunks: int, num_steps: int) -> int:
    """The largest divisor of `num_chunks` that is <= `num_steps`.

    The fused kernels' time grid has `num_chunks // steps` iterations of `steps` chunks each,
    so `steps` must divide the number of chunks NT (e.g. NT = 6 with num_steps = 4 gives 3;
    a prime NT larger than num_steps gives 1).
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks: expected a positive number of chunks, got {num_chunks}")
    if num_steps < 1:
        raise ValueError(f"num_steps: expected a positive number of chunks per grid iteration, got {num_steps}")
    return next(steps for steps in range(min(num_steps, num_chunks), 0, -1) if num_chunks % steps == 0)


def block_tokens_for(seq_len: int, chunk: int, block_tokens: int) -> int:
    """Tokens per grid step of the forward kernel for a sequence of `seq_len`: the largest multiple
    of `chunk` that is <= max(block_tokens, chunk) and divides T rounded up to the chunk."""
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"kernel_chunk: expected a power of two, got {chunk}")
    chunks = max(1, -(-seq_len // chunk))
    return chunk * effective_num_steps(chunks, max(1, block_tokens // chunk))
