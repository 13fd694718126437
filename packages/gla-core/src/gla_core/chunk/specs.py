"""Block shapes and index maps of the chunk kernels, in one place.

Kernel inputs live in `[B, H, Tp, D]` (time-major per head, D padded to 128 lanes), scalar
gates in `[B, H, NT, 1, C]` ("scalar" mode) or `[B, H, NT / n, n*C / 128, 128]` ("broadcast"
mode), per-chunk states in `[B, H, NT, V, K]`, per-chunk intra-chunk scores in
`[B, H, NF, NT, C, C]`, per-sequence states in `[N, H, V, K]`. Grids are `(B, H, NF, NT / n)`:
the third axis tiles one feature dimension (V for the state and output kernels, K for the
dq/dk/dgate kernel), the last is time. With scalar prefetch the index maps also receive the
per-chunk metadata refs `(first, last, sequence)` after the grid indices. Per-sequence states of
packed calls with several chunks per step are not blocked: they stay in HBM (`state_of_sequence`,
`packed`).
"""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

from gla_core.chunk.packed import PackedLayout
from gla_core.tpu import NUM_LANES


def chunks_per_step(num_chunks: int, most: int) -> int:
    """The largest number of chunks per grid step that divides `num_chunks` and is <= `most`."""
    return max(d for d in range(1, min(most, num_chunks) + 1) if num_chunks % d == 0)


@dataclasses.dataclass(frozen=True)
class ChunkSpecs:
    """BlockSpecs for one call.

    Attributes:
      gate_mode: "scalar" (gate blocks `[1, C]`, one chunk at a time), "key" (`[n*C, Kt]`, the n
        chunks of a grid step together) or "broadcast" (a scalar gate as `[n*C / 128, 128]`, 128
        steps per row, taken by the kernels of "key" mode broadcast over the keys,
        `batched.gate_rows`; n*C a multiple of 128).
      chunk: C, the time tile.
      num_chunks: NT.
      key_dim, value_dim: padded K and V.
      block_k, block_v: K and V tiles; the one of the untiled dimension is the whole dimension.
      tiled: which feature dimension the third grid axis tiles, "v" or "k".
      reverse: the time grid axis runs from the last chunk to the first.
      states_per_row: per-sequence states of one batch row (1 for fixed length, N for varlen):
        a chunk's state is row `b * states_per_row + sequence` of the `[N, ...]` states.
      varlen: the row holds `cu_seqlens` sequences: each may start and end at any chunk (the
        layout pads every sequence to whole chunks and the row to its static worst case, so even
        one sequence may end before the row's last chunk).
      chunks_per_step: n, consecutive chunks of one grid step (a divisor of NT): time blocks
        are `[n*C, D]`, per-chunk blocks `[n, ...]` (`launch.for_each_chunk` runs the kernel
        per chunk). 1 keeps single-chunk blocks without the chunk axis.
    """

    gate_mode: str
    chunk: int
    num_chunks: int
    key_dim: int
    value_dim: int
    block_k: int
    block_v: int
    tiled: str = "v"
    reverse: bool = False
    states_per_row: int = 1
    chunks_per_step: int = 1
    varlen: bool = False

    def __post_init__(self):
        untiled_block = self.block_k if self.tiled == "v" else self.block_v
        untiled_dim = self.key_dim if self.tiled == "v" else self.value_dim
        if untiled_block != untiled_dim:
            raise ValueError(f"tiled={self.tiled!r}: the other feature dimension must be one block")
        if self.num_chunks % self.chunks_per_step:
            raise ValueError(f"chunks_per_step: {self.chunks_per_step} must divide the {self.num_chunks} chunks")

    @classmethod
    def value_tiled(
        cls, gate_mode, chunk, num_chunks, key_dim, value_dim, block_v, states_per_row: int = 1, varlen: bool = False
    ) -> ChunkSpecs:
        """Specs of the kernels that tile V and see all of K."""
        return cls(
            gate_mode,
            chunk,
            num_chunks,
            key_dim,
            value_dim,
            block_k=key_dim,
            block_v=block_v,
            states_per_row=states_per_row,
            varlen=varlen,
        )

    def key_tiled(self, block_k: int) -> ChunkSpecs:
        """The same call, tiling K (all of V in every block)."""
        return dataclasses.replace(self, block_k=block_k, block_v=self.value_dim, tiled="k")

    def with_chunks_per_step(self, most: int) -> ChunkSpecs:
        """The same call with the largest number of chunks per grid step that divides NT and is <= `most`."""
        return dataclasses.replace(self, chunks_per_step=chunks_per_step(self.num_chunks, most))

    def reversed(self) -> ChunkSpecs:
        """The same call, walking time backwards."""
        return dataclasses.replace(self, reverse=True)

    @property
    def per_step(self) -> bool:
        """Whether the kernels take the n chunks of a grid step together with per-key decays ("key"
        and "broadcast" modes) rather than chunk by chunk ("scalar")."""
        return self.gate_mode != "scalar"

    @property
    def num_tiles(self) -> int:
        """Size of the third grid axis."""
        return self.value_dim // self.block_v if self.tiled == "v" else self.key_dim // self.block_k

    @property
    def num_steps(self) -> int:
        """Grid steps along time, NT / n."""
        return self.num_chunks // self.chunks_per_step

    def grid(self, batch: int, heads: int) -> tuple[int, int, int, int]:
        """(B, H, NF, NT / n)."""
        return batch, heads, self.num_tiles, self.num_steps

    def _per_chunk(self, *block: int) -> tuple:
        """A per-chunk block: the chunk axis squeezed for one chunk per step, n wide otherwise."""
        return (None if self.chunks_per_step == 1 else self.chunks_per_step, *block)

    def _position(self, indices):
        """(batch, head, V tile, K tile, time block) of a grid point; trailing prefetch refs are ignored."""
        b, h, tile, t = indices[:4]
        chunk = self.num_steps - 1 - t if self.reverse else t
        if self.tiled == "v":
            return b, h, tile, 0, chunk
        return b, h, 0, tile, chunk

    def key(self) -> pl.BlockSpec:
        """q, k, dq, dk or a per-key gate: [n*C, Kt] of [B, H, Tp, K]."""

        def key_index(*indices):
            b, h, _, kt, c = self._position(indices)
            return b, h, c, kt

        return pl.BlockSpec((None, None, self.chunk * self.chunks_per_step, self.block_k), key_index)

    def value(self) -> pl.BlockSpec:
        """v, o, do or dv: [n*C, Vt] of [B, H, Tp, V]."""

        def value_index(*indices):
            b, h, vt, _, c = self._position(indices)
            return b, h, c, vt

        return pl.BlockSpec((None, None, self.chunk * self.chunks_per_step, self.block_v), value_index)

    def gate(self) -> pl.BlockSpec:
        """The per-step log decays by `gate_mode`: [(n,) 1, C] of [B, H, NT, 1, C], [n*C, Kt] of
        [B, H, Tp, K] or [n*C / 128, 128] of [B, H, NT / n, n*C / 128, 128]."""
        if self.gate_mode == "key":
            return self.key()
        if self.gate_mode == "broadcast":

            def broadcast_gate_index(*indices):
                b, h, _, _, c = self._position(indices)
                return b, h, c, 0, 0

            rows = self.chunk * self.chunks_per_step // NUM_LANES
            return pl.BlockSpec((None, None, None, rows, NUM_LANES), broadcast_gate_index)

        def scalar_gate_index(*indices):
            b, h, _, _, c = self._position(indices)
            return b, h, c, 0, 0

        return pl.BlockSpec((None, None, *self._per_chunk(1, self.chunk)), scalar_gate_index)

    def scalar_gate_partial(self) -> pl.BlockSpec:
        """A scalar-gate gradient per K tile: [(n,) 1, C] of [B, H, NK, NT, 1, C] (summed over NK outside)."""

        def scalar_gate_partial_index(*indices):
            b, h, _, kt, c = self._position(indices)
            return b, h, kt, c, 0, 0

        return pl.BlockSpec((None, None, None, *self._per_chunk(1, self.chunk)), scalar_gate_partial_index)

    def chunk_state(self) -> pl.BlockSpec:
        """A per-chunk state: [(n,) Vt, Kt] of [B, H, NT, V, K]."""

        def chunk_state_index(*indices):
            b, h, vt, kt, c = self._position(indices)
            return b, h, c, vt, kt

        return pl.BlockSpec((None, None, *self._per_chunk(self.block_v, self.block_k)), chunk_state_index)

    def chunk_scores(self) -> pl.BlockSpec:
        """A chunk's intra-chunk scores, one copy per V tile: [(n,) C, C] of [B, H, NF, NT, C, C]."""

        def chunk_scores_index(*indices):
            b, h, vt, _, c = self._position(indices)
            return b, h, vt, c, 0, 0

        return pl.BlockSpec((None, None, None, *self._per_chunk(self.chunk, self.chunk)), chunk_scores_index)

    @property
    def packed(self) -> bool:
        """Whether sequences of one batch row may start and end inside a grid step (varlen, several
        chunks per step): the per-sequence states then stay in HBM and move by DMA (`packed`)."""
        return self.varlen and self.chunks_per_step != 1

    def packed_layout(self) -> PackedLayout | None:
        """The static layout of the per-sequence states for the kernels of a packed call, else None."""
        return PackedLayout(self.states_per_row, self.block_v) if self.packed else None

    def state_of_sequence(self) -> pl.BlockSpec:
        """The state of the sequence owning the chunk: [Vt, Kt] of [N, H, V, K] (needs scalar prefetch).
        Packed calls (`packed`): the whole [N, H, V, K] left in HBM, for the kernels' DMAs."""
        if self.packed:
            return pl.BlockSpec(memory_space=pl.ANY)

        def sequence_state_index(*indices):
            b, h, vt, kt, c = self._position(indices)
            sequence_ref = indices[4:][2]
            return b * self.states_per_row + sequence_ref[c], h, vt, kt

        return pl.BlockSpec((None, None, self.block_v, self.block_k), sequence_state_index)
