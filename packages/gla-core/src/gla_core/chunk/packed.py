"""Per-sequence states of packed sequences when a grid step walks several chunks.

A packed varlen row (B == 1, `cu_seqlens`) holds its sequences padded to whole chunks and the row
padded to its static worst case, so they may start and end at any chunk of a grid step (even a
single sequence may end before the row's last chunk). Their states `[N, H, V, K]` (float32: the
initial states h0 or final-state gradients dht in, the final states ht or initial-state gradients
dh0 out) then stay in HBM (`ChunkSpecs.state_of_sequence`: `memory_space=ANY`) and move by DMA
at the chunks the scalar-prefetched metadata marks: the chunk that starts a sequence in walking order resets the
carried state from its sequence's entry (zero without one), the chunk that ends it writes the
carried state to its sequence's entry. Walking backwards the roles swap: a sequence starts at its
last chunk (`ChunkMeta.last`) and ends at its first.

Every grid point (batch row, head, V tile) reads and writes only its own `[Vt, K]` slice of the
states, so the parallel grid axes stay race free. An output entry no chunk ends (an empty
sequence's) is never written; the pipeline replaces those (`layout.empty_sequence`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Static facts of the per-sequence states of a packed call (hashable, a kernel argument).

    Attributes:
      states_per_row: N, the sequences of one batch row: a chunk's state is row
        `b * states_per_row + sequence[chunk]` of the `[B * N, H, V, K]` states.
      block_v: the V tile of the grid's third axis (the state slice `[Vt, K]` of a grid point).
    """

    states_per_row: int
    block_v: int

    def states(self, starts_ref, ends_ref, sequence_ref, initial_ref, final_ref) -> SequenceStates:
        """The per-sequence states of one kernel run (see `SequenceStates`)."""
        return SequenceStates(self, starts_ref, ends_ref, sequence_ref, initial_ref, final_ref)


@dataclasses.dataclass(frozen=True)
class SequenceStates:
    """The per-sequence states seen by a kernel walking packed sequences.

    Attributes:
      layout: the static `PackedLayout`.
      starts_ref, ends_ref: int32 [NT] (SMEM): 1 where a chunk starts / ends a sequence in
        walking order (forwards: `ChunkMeta.first` / `last`; backwards: `last` / `first`).
      sequence_ref: int32 [NT] (SMEM): the chunk's sequence within its batch row.
      initial_ref: the states entering the sequences, float32 [B*N, H, V, K] in HBM, or None (zero).
      final_ref: the states leaving them, float32 [B*N, H, V, K] in HBM, or None (not wanted).
    """

    layout: PackedLayout
    starts_ref: jax.Array
    ends_ref: jax.Array
    sequence_ref: jax.Array
    initial_ref: jax.Array | None
    final_ref: jax.Array | None

    def entry(self, states_ref, chunk):
        """The `[Vt, K]` slice of `states_ref` [B*N, H, V, K] of this grid point and `chunk`'s sequence."""
        row = pl.program_id(0) * self.layout.states_per_row + self.sequence_ref[chunk]
        tile = pl.ds(pl.program_id(2) * self.layout.block_v, self.layout.block_v)
        return states_ref.at[row, pl.program_id(1), tile]

    def starts(self, chunk) -> jax.Array:
        """bool scalar: `chunk` starts a sequence (in walking order)."""
        return self.starts_ref[chunk] == 1

    def reset(self, state_ref, chunk) -> None:
        """Where `chunk` starts a sequence, `state_ref` [Vt, K] float32 (VMEM) becomes its initial
        state (a DMA from HBM) or zero."""

        @pl.when(self.starts(chunk))
        def _reset():
            if self.initial_ref is None:
                state_ref[...] = jnp.zeros(state_ref.shape, jnp.float32)
            else:
                pltpu.sync_copy(self.entry(self.initial_ref, chunk), state_ref)

    def emit(self, state_ref, chunk) -> None:
        """Where `chunk` ends a sequence, writes `state_ref` [Vt, K] float32 (VMEM) to its final
        state (a DMA to HBM); nothing without final states."""
        if self.final_ref is None:
            return

        @pl.when(self.ends_ref[chunk] == 1)
        def _emit():
            pltpu.sync_copy(state_ref, self.entry(self.final_ref, chunk))


@dataclasses.dataclass(frozen=True)
class ChainEdges:
    """Sequence edges inside the state chain of a grid step taken at once (`batched.state_chain`).

    Chain index i is the step's chunk `base + i`. `slot_ref` ([Vt, K] float32 VMEM) carries the
    DMAs: the kernel's carried-state scratch, free while the chain runs on values (the kernel
    loads the state entering the step before the chain and stores the one leaving it after).
    """

    states: SequenceStates
    slot_ref: jax.Array
    base: jax.Array

    def restart(self, i: int, state: jax.Array) -> jax.Array:
        """The state chunk i sees before its update: its sequence's initial state (or zero) where it
        starts one, else `state` ([1, Vt, K] float32)."""
        chunk = self.base + i
        flag = jnp.full(state.shape, self.states.starts_ref[chunk], jnp.int32) == 1
        if self.states.initial_ref is None:
            return jnp.where(flag, 0.0, state)
        self.states.reset(self.slot_ref, chunk)
        return jnp.where(flag, self.slot_ref[...][None], state)  # the slot is stale where flag is off

    def emit(self, i: int, state: jax.Array) -> None:
        """Writes `state` ([1, Vt, K] float32, after chunk i's update) where chunk i ends a sequence."""
        if self.states.final_ref is None:
            return
        chunk = self.base + i

        @pl.when(self.states.ends_ref[chunk] == 1)
        def _emit():
            self.slot_ref[...] = state[0]
            pltpu.sync_copy(self.slot_ref, self.states.entry(self.states.final_ref, chunk))
