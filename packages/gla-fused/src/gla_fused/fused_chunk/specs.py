"""Block shapes and index maps of the fused kernels: `num_steps` consecutive chunks per block.

Tensors are those of `gla_core.chunk.prepare`: q/k `[B, H, Tp, Kp]`, v/o/do/dv `[B, H, Tp, Vp]`,
scalar gates `[B, H, NT, 1, C]`, per-chunk states `[B, H, NT, Vp, Kp]`, per-sequence states
`[B, H, Vp, Kp]` (fixed length: one state per batch row). The grid is `(B, H, NV, NI)` with
NI = NT / num_steps iterations along time; V is tiled, all of K is in every block.
"""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class FusedSpecs:
    """BlockSpecs of one call.

    Attributes:
      chunk: C.
      num_steps: S, chunks per grid iteration (divides num_chunks).
      num_chunks: NT.
      key_dim, value_dim: padded K and V (multiples of 128).
      block_v: the V tile.
      reverse: the time grid axis walks from the last iteration to the first.
    """

    chunk: int
    num_steps: int
    num_chunks: int
    key_dim: int
    value_dim: int
    block_v: int
    reverse: bool = False

    def __post_init__(self):
        if self.num_chunks % self.num_steps:
            raise ValueError(f"num_steps: {self.num_steps} does not divide the {self.num_chunks} chunks")
        if self.value_dim % self.block_v:
            raise ValueError(f"block_v: {self.block_v} does not divide the value dim {self.value_dim}")

    @property
    def num_iterations(self) -> int:
        """NI, the size of the time grid axis."""
        return self.num_chunks // self.num_steps

    @property
    def num_value_tiles(self) -> int:
        return self.value_dim // self.block_v

    def grid(self, batch: int, heads: int) -> tuple[int, int, int, int]:
        """(B, H, NV, NI)."""
        return batch, heads, self.num_value_tiles, self.num_iterations

    def reversed(self) -> FusedSpecs:
        return dataclasses.replace(self, reverse=True)

    def _iteration(self, step):
        """The block index along time of grid step `step`."""
        return self.num_iterations - 1 - step if self.reverse else step

    @property
    def _rows(self) -> int:
        return self.num_steps * self.chunk

    def key(self) -> pl.BlockSpec:
        """q or k: [S*C, K] of [B, H, Tp, K]."""

        def key_index(b, h, vt, step):
            return b, h, self._iteration(step), 0

        return pl.BlockSpec((None, None, self._rows, self.key_dim), key_index)

    def value(self) -> pl.BlockSpec:
        """v, o, do or dv: [S*C, Vt] of [B, H, Tp, V]."""

        def value_index(b, h, vt, step):
            return b, h, self._iteration(step), vt

        return pl.BlockSpec((None, None, self._rows, self.block_v), value_index)

    def gate(self) -> pl.BlockSpec:
        """The per-step log decays of S chunks: [S, 1, C] of [B, H, NT, 1, C]."""

        def gate_index(b, h, vt, step):
            return b, h, self._iteration(step), 0, 0

        return pl.BlockSpec((None, None, self.num_steps, 1, self.chunk), gate_index)

    def chunk_states(self) -> pl.BlockSpec:
        """S per-chunk states: [S, Vt, K] of [B, H, NT, V, K]."""

        def chunk_states_index(b, h, vt, step):
            return b, h, self._iteration(step), vt, 0

        return pl.BlockSpec((None, None, self.num_steps, self.block_v, self.key_dim), chunk_states_index)

    def state(self) -> pl.BlockSpec:
        """The state of the batch row (initial or final, or their gradients): [Vt, K] of [B, H, V, K]."""

        def state_index(b, h, vt, step):
            return b, h, vt, 0

        return pl.BlockSpec((None, None, self.block_v, self.key_dim), state_index)
