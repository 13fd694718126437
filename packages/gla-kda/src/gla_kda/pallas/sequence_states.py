"""Per-sequence states of packed sequences in the state kernels, when a grid step walks several chunks.

A packed row's sequences may start and end at any chunk of a grid step, so the state kernels
(`state`, `state_bwd`) cannot pick a sequence's entering and leaving states `[N, HV, K, V]`
(float32) with one block per grid step. These then stay in HBM (`memory_space=pl.ANY`) and move
by DMA at the chunks the scalar-prefetched metadata marks: a chunk that starts a sequence in
walking order takes its sequence's entering state (zero without one) instead of the carried one, a
chunk that ends it writes the carried state to its sequence's entry. Walking backwards (the state
gradients) the roles swap: a sequence starts at its last chunk and ends at its first.

Grid point (b, j, t) reads and writes only rows `b * N/B + sequence` and value heads
`j*m .. j*m + m - 1` of the states, so the parallel grid axes stay race free. An entry no chunk
ends (an empty sequence's) is never written; the pipeline masks those.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_kda.pallas.chunk_math import finite
from gla_kda.pallas.poison import nonfinite_columns


def state_spec(packed: bool, heads: int, key_dim: int, value_dim: int) -> pl.BlockSpec:
    """The spec of a state kernel's per-sequence states [N, HV, K, V] on its (batch, value-head
    block, time) grid: all of them in HBM for a packed row (`SequenceStates`), else the [m, K, V]
    block of batch row b and the m = `heads` value heads of block j (one sequence per row)."""
    if packed:
        return pl.BlockSpec(memory_space=pl.ANY)
    return pl.BlockSpec((None, heads, key_dim, value_dim), lambda b, j, t, *_: (b, j, 0, 0))


def starts_row(t, first_ref, per_step: int, packed: bool):
    """Whether grid step t (walking time forwards) starts its batch row's carried state over: its
    first step, or (one sequence per row) a step whose first chunk starts the sequence. A packed
    row restarts chunk by chunk instead (`SequenceStates.restart_finite`)."""
    return (t == 0) if packed else (t == 0) | (first_ref[t * per_step] == 1)


def initial_states(h0_ref, state_ref, poisoned_ref=None):
    """Sets the carried states [m, K, V] to the initial states h0 [m, K, V] (raw) with non-finite
    entries read as 0 (zeros when h0_ref is None), and the poisoned columns [m, 1, V] (if given) to
    h0's non-finite columns (`poison.nonfinite_columns`)."""
    if h0_ref is None:
        state_ref[...] = jnp.zeros(state_ref.shape, state_ref.dtype)
        if poisoned_ref is not None:
            poisoned_ref[...] = jnp.zeros(poisoned_ref.shape, poisoned_ref.dtype)
        return
    for i in range(state_ref.shape[0]):
        raw = h0_ref[i].astype(jnp.float32)
        state_ref[i] = finite(raw)
        if poisoned_ref is not None:
            poisoned_ref[i] = nonfinite_columns(raw)


@dataclasses.dataclass(frozen=True)
class SequenceStates:
    """The per-sequence states a state kernel walking a packed row reads and writes.

    Attributes:
      starts_ref, ends_ref: int32 [NT] (SMEM): 1 where a chunk starts / ends a sequence in walking
        order (forwards: `ChunkMeta.first` / `last`; backwards: `last` / `first`).
      sequence_ref: int32 [NT] (SMEM): the chunk's sequence within its batch row.
      entering_ref: the states entering the sequences, float32 [N, HV, K, V] in HBM, or None (zero).
      leaving_ref: the states leaving them, float32 [N, HV, K, V] in HBM, or None (not wanted).
      slot_ref: float32 [m, K, V] VMEM scratch the DMAs go through.
      states_per_row: N / B.
    """

    starts_ref: jax.Array
    ends_ref: jax.Array
    sequence_ref: jax.Array
    entering_ref: jax.Array | None
    leaving_ref: jax.Array | None
    slot_ref: jax.Array
    states_per_row: int

    def _entry(self, states_ref, chunk):
        """The [m, K, V] entry of `states_ref` of this grid point's heads and `chunk`'s sequence."""
        row = pl.program_id(0) * self.states_per_row + self.sequence_ref[chunk]
        heads = self.slot_ref.shape[0]
        return states_ref.at[row, pl.ds(pl.program_id(1) * heads, heads)]

    def _entering(self, chunk):
        """The entering states [K, V] (one per head) of `chunk`'s sequence, loaded where it starts one
        (stale elsewhere), or None without entering states."""
        if self.entering_ref is None:
            return None

        @pl.when(self.starts_ref[chunk] == 1)
        def _load():
            pltpu.sync_copy(self._entry(self.entering_ref, chunk), self.slot_ref)

        return [self.slot_ref[i] for i in range(self.slot_ref.shape[0])]

    def restart(self, chunk, states: list[jax.Array]) -> list[jax.Array]:
        """The states [K, V] (one per head) `chunk` sees before its update: its sequence's entering
        states (or zero) where it starts one, else `states`."""
        entering = self._entering(chunk)
        return [
            jnp.where(self._starts(chunk, state.shape), 0.0 if entering is None else entering[i], state)
            for i, state in enumerate(states)
        ]

    def restart_finite(self, chunk, states: list[jax.Array], poisoned: list[jax.Array] | None):
        """`restart` with the entering states' non-finite entries read as 0, and the flags
        `poisoned` [1, V] (one per head, or None) restarted with them: where `chunk` starts a
        sequence, 1 in the columns its entering state holds a non-finite entry in
        (`poison.nonfinite_columns`), else 0. Returns (states, flags)."""
        entering = self._entering(chunk)
        restarted, flags = [], []
        for i, state in enumerate(states):
            entering_state = 0.0 if entering is None else finite(entering[i])
            restarted.append(jnp.where(self._starts(chunk, state.shape), entering_state, state))
            if poisoned is not None:
                entering_flags = 0.0 if entering is None else nonfinite_columns(entering[i])
                flags.append(jnp.where(self._starts(chunk, poisoned[i].shape), entering_flags, poisoned[i]))
        return restarted, None if poisoned is None else flags

    def restart_flags(self, chunk, poisoned: list[jax.Array]) -> list[jax.Array]:
        """The flags of `restart_finite` alone (the entering states loaded again where `chunk` starts a
        sequence)."""
        entering = self._entering(chunk)
        return [
            jnp.where(
                self._starts(chunk, flags.shape), 0.0 if entering is None else nonfinite_columns(entering[i]), flags
            )
            for i, flags in enumerate(poisoned)
        ]

    def _starts(self, chunk, shape):
        """bool `shape`: `chunk` starts a sequence (a full vector: Mosaic selects no scalar masks)."""
        return jnp.full(shape, self.starts_ref[chunk], jnp.int32) == 1

    def emit(self, chunk, states: list[jax.Array]) -> None:
        """Writes `states` [K, V] (one per head, after `chunk`'s update) where `chunk` ends a sequence."""
        if self.leaving_ref is None:
            return

        @pl.when(self.ends_ref[chunk] == 1)
        def _store():
            for i, state in enumerate(states):
                self.slot_ref[i] = state
            pltpu.sync_copy(self.slot_ref, self._entry(self.leaving_ref, chunk))
