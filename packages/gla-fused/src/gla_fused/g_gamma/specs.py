"""Block shapes and index maps of the two fused g_gamma kernels.

Tensors use the chunk kernels' layout (`gla_core.chunk.prepare`): q, k `[B, H, Tp, Kp]`,
v, o, do `[B, H, Tp, Vp]`, states transposed `[B, H, Vp, Kp]`. Both grids are
`(B, H, NV, steps)`, NV the number of V tiles; the time axis walks

  forward:   steps = NT,     chunk c = step
  backward:  steps = 2 NT,   chunk c = min(step, 2 NT - 1 - step)

so the backward's first half walks the chunks forwards and its second half walks them
backwards through the index maps (no flipped copies). An output written in one half only
keeps, during the other half, the index of the block that half writes last (dq) or first
(dk, dv): consecutive steps with the same block index neither flush nor refetch it, so a
block is written back to HBM only after the kernel has filled it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_core.kit import NUM_LANES, NUM_SUBLANES

PARTIAL_BLOCK = (NUM_SUBLANES, NUM_LANES)  # one (8, 128) tile per (b, h, V tile) for d gamma


@dataclasses.dataclass(frozen=True)
class GammaSpecs:
    """BlockSpecs of one call.

    Attributes:
      chunk: C, the time tile.
      num_chunks: NT.
      key_dim: padded K (every block holds all of it).
      block_v: the V tile.
      backward: the time axis has 2 NT steps (see the module docstring).
    """

    chunk: int
    num_chunks: int
    key_dim: int
    block_v: int
    backward: bool = False

    @property
    def num_steps(self) -> int:
        return 2 * self.num_chunks if self.backward else self.num_chunks

    def grid(self, batch: int, heads: int, value_dim: int) -> tuple[int, int, int, int]:
        """(B, H, NV, steps)."""
        return batch, heads, value_dim // self.block_v, self.num_steps

    def chunk_of(self, step):
        """The chunk a step reads."""
        if not self.backward:
            return step
        return jnp.minimum(step, 2 * self.num_chunks - 1 - step)

    def gamma(self) -> pl.BlockSpec:
        """g_gamma [H] float32, whole, in SMEM (the kernels read their head's scalar)."""
        return pl.BlockSpec(memory_space=pltpu.SMEM)

    def key(self) -> pl.BlockSpec:
        """q or k: [C, Kp] of [B, H, Tp, Kp]."""

        def key_index(b, h, vt, step):
            return b, h, self.chunk_of(step), 0

        return pl.BlockSpec((None, None, self.chunk, self.key_dim), key_index)

    def value(self) -> pl.BlockSpec:
        """v, o or do: [C, Vt] of [B, H, Tp, Vp]."""

        def value_index(b, h, vt, step):
            return b, h, self.chunk_of(step), vt

        return pl.BlockSpec((None, None, self.chunk, self.block_v), value_index)

    def state(self) -> pl.BlockSpec:
        """h0, ht, dht or dh0: [Vt, Kp] of [B, H, Vp, Kp] (one block per (b, h, V tile))."""

        def state_index(b, h, vt, step):
            return b, h, vt, 0

        return pl.BlockSpec((None, None, self.block_v, self.key_dim), state_index)

    def query_grad(self) -> pl.BlockSpec:
        """dq per V tile, written in the first half: [C, Kp] of [B, H, NV, Tp, Kp]."""

        def query_grad_index(b, h, vt, step):
            return b, h, vt, jnp.minimum(step, self.num_chunks - 1), 0

        return pl.BlockSpec((None, None, None, self.chunk, self.key_dim), query_grad_index)

    def key_grad(self) -> pl.BlockSpec:
        """dk per V tile, written in the second half: [C, Kp] of [B, H, NV, Tp, Kp]."""

        def key_grad_index(b, h, vt, step):
            return b, h, vt, self._second_half_chunk(step), 0

        return pl.BlockSpec((None, None, None, self.chunk, self.key_dim), key_grad_index)

    def value_grad(self) -> pl.BlockSpec:
        """dv, written in the second half: [C, Vt] of [B, H, Tp, Vp]."""

        def value_grad_index(b, h, vt, step):
            return b, h, self._second_half_chunk(step), vt

        return pl.BlockSpec((None, None, self.chunk, self.block_v), value_grad_index)

    def gamma_grad(self) -> pl.BlockSpec:
        """d gamma partial sum of a (b, h, V tile): an (8, 128) tile of [B, H, NV, 8, 128]."""

        def gamma_grad_index(b, h, vt, step):
            return b, h, vt, 0, 0

        return pl.BlockSpec((None, None, None, *PARTIAL_BLOCK), gamma_grad_index)

    def _second_half_chunk(self, step):
        # chunk NT - 1 during the first half (the block the second half writes first)
        return jnp.minimum(self.num_chunks - 1, 2 * self.num_chunks - 1 - step)
