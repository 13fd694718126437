"""Shared Pallas TPU chunk kernels of gated linear attention (simple_gla and gla), fixed and varlen.

Kernel families, one module each: `fwd` (the forward: outputs and final states), `fwd_h`
(states before every chunk, for the backward), `bwd_dh` (state gradients), `bwd_dv` (value
gradients), `bwd_dqkg` (query, key and gate gradients). `prepare` re-lays the op's tensors for
the kernels, `gates` holds the in-kernel overflow-safe decay products (and the floor that keeps
hard resets of -inf exact), `empty` answers calls without tokens, `pipeline` is the
differentiable op.
"""

from gla_core.chunk.common import DEFAULT_BLOCK_SIZES, BlockSizes
from gla_core.chunk.pipeline import chunk_gated_attention

__all__ = ["DEFAULT_BLOCK_SIZES", "BlockSizes", "chunk_gated_attention"]
