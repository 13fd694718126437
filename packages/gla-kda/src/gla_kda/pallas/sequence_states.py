"""Per-sequence states of packed sequences in the state kernels, when a grid step walks several chunks.

A packed row's sequences may start and end at any chunk of a grid step, so the state kernels
(`state`, `state_bwd`) cannot pick a sequence's entering and leaving states `[N, HV, K, V]`
(float32) with one block per grid step. When they are few (`resident_states`), all those of a block of
value heads stay in VMEM while the kernel walks the row (one head-major block `[m, N/B, K, V]`); else
they stay in HBM (`memory_space=pl.ANY`). Either way they are copied (in VMEM, or by DMA) before and
after each grid step, for the chunks the scalar-prefetched metadata marks
(`SequenceStates`): a chunk that starts a sequence in
walking order takes its sequence's entering state (zero without one) instead of the carried one, a
chunk that ends it writes the carried state to its sequence's entry. Walking backwards (the state
gradients) the roles swap: a sequence starts at its last chunk and ends at its first.

Grid point (b, j, t) reads and writes only sequences `b * N/B ..` and value heads
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

# The most bytes of per-sequence states a packed row's kernel keeps in VMEM for a whole block of value
# heads (`resident_states`; the pipeline holds two buffers of each such block, entering and leaving).
# Above, they move by DMA. libtpu's static estimate charges every conditional DMA, taken or not (v6e,
# kda_state on a packed row of 4 sequences, B=1 T=8192 H=16: 556.6k cycles by DMA, 460.5k in VMEM).
RESIDENT_STATES_BYTES = 2 * 2**20


def resident_states(packed: bool, states_per_row: int, heads: int, key_dim: int, value_dim: int) -> bool:
    """Whether a packed row's per-sequence states (all N of a block of m = `heads` value heads) stay in
    VMEM for the whole row: at most `RESIDENT_STATES_BYTES` of them."""
    return packed and states_per_row * heads * key_dim * value_dim * 4 <= RESIDENT_STATES_BYTES


def state_spec(packed: bool, heads: int, key_dim: int, value_dim: int, states_per_row: int = 1) -> pl.BlockSpec:
    """The spec of a state kernel's per-sequence states on its (batch, value-head block, time) grid:
    one sequence per row: the [m, K, V] block of [N, HV, K, V] of batch row b and the m = `heads`
    value heads of block j; a packed row with `resident_states`: the [m, N/B, K, V] block of the
    head-major [HV, N, K, V] (`to_kernel_states`), the same for every time step; other packed rows:
    all of [N, HV, K, V] in HBM (`SequenceStates` moves them by DMA)."""
    if resident_states(packed, states_per_row, heads, key_dim, value_dim):
        return pl.BlockSpec((heads, states_per_row, key_dim, value_dim), lambda b, j, t, *_: (j, b, 0, 0))
    if packed:
        return pl.BlockSpec(memory_space=pl.ANY)
    return pl.BlockSpec((None, heads, key_dim, value_dim), lambda b, j, t, *_: (b, j, 0, 0))


def to_kernel_states(states, resident: bool):
    """Per-sequence states [N, HV, K, V] as `state_spec` takes them: head-major when `resident`."""
    return jnp.swapaxes(states, 0, 1) if resident else states


def kernel_states_shape(num_states: int, heads: int, key_dim: int, value_dim: int, resident: bool) -> tuple:
    """The shape of per-sequence states a kernel writes (`to_kernel_states` of [N, HV, K, V])."""
    return (heads, num_states, key_dim, value_dim) if resident else (num_states, heads, key_dim, value_dim)


from_kernel_states = to_kernel_states  # the swap is its own inverse


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


def sequence_scratch(per_step: int, heads: int, key_dim: int, value_dim: int, leaving: bool) -> list:
    """The scratch `SequenceStates` takes: the entering states' slots [n, m, K, V] float32, and with
    `leaving` the leaving states' slots too."""
    slots = pltpu.VMEM((per_step, heads, key_dim, value_dim), jnp.float32)
    return [slots, slots] if leaving else [slots]


@dataclasses.dataclass(frozen=True)
class SequenceStates:
    """The per-sequence states a state kernel walking a packed row reads and writes in one grid
    step of n chunks (chunk `first_chunk + j` at slot j).

    The DMAs happen around the step's computation, not inside it (a conditional DMA per chunk cuts
    the step's straight-line code into pieces the scheduler cannot interleave): `load` brings the
    entering states of the sequences the step's chunks start into their slots before it, `keep`
    puts every chunk's states into its leaving slot, and `store` writes those of the chunks that
    end a sequence after it. Each DMA is waited for where it starts: libtpu's static estimate of
    the state kernel on a packed row (v6e, B=1 T=2048 H=4, 4 sequences) is 41.5k cycles so,
    51.7k with the DMAs inside the step, 66.6k with every DMA of a step in flight at once (a
    branch to start each and one to wait for each).

    Attributes:
      starts_ref, ends_ref: int32 [NT] (SMEM): 1 where a chunk starts / ends a sequence in walking
        order (forwards: `ChunkMeta.first` / `last`; backwards: `last` / `first`).
      sequence_ref: int32 [NT] (SMEM): the chunk's sequence within its batch row.
      entering_ref: the states entering the sequences, float32 [N, HV, K, V] in HBM, or None (zero).
      leaving_ref: the states leaving them, float32 [N, HV, K, V] in HBM, or None (not wanted).
      scratch: `sequence_scratch` (with leaving slots exactly when leaving_ref is given).
      first_chunk: the step's first chunk (scalar int32).
      states_per_row: N / B.
      resident: entering_ref and leaving_ref are the row's VMEM blocks [m, N/B, K, V]
        (`resident_states`): the transfers are VMEM copies, not DMAs.
    """

    starts_ref: jax.Array
    ends_ref: jax.Array
    sequence_ref: jax.Array
    entering_ref: jax.Array | None
    leaving_ref: jax.Array | None
    scratch: tuple
    first_chunk: jax.Array
    states_per_row: int
    resident: bool = False

    @property
    def _entering_slots(self):
        return self.scratch[0]

    @property
    def _leaving_slots(self):
        return self.scratch[1] if self.leaving_ref is not None else None

    def _transfer(self, marks_ref, outgoing: bool) -> None:
        """Copies slot j's entering states in, or (`outgoing`) its leaving states out, for every
        slot whose chunk `marks_ref` marks."""
        heads = self._entering_slots.shape[1]
        entry = pl.ds(pl.program_id(1) * heads, heads)
        for j in range(self._entering_slots.shape[0]):
            chunk = self.first_chunk + j

            @pl.when(marks_ref[chunk] == 1)
            def _copy(j=j, chunk=chunk):
                if self.resident:  # the row's states are a VMEM block [m, N/B, K, V]
                    sequence = self.sequence_ref[chunk]
                    for i in range(heads):
                        if outgoing:
                            self.leaving_ref[i, sequence] = self._leaving_slots[j, i]
                        else:
                            self._entering_slots[j, i] = self.entering_ref[i, sequence]
                    return
                row = pl.program_id(0) * self.states_per_row + self.sequence_ref[chunk]
                if outgoing:
                    pltpu.sync_copy(self._leaving_slots.at[j], self.leaving_ref.at[row, entry])
                else:
                    pltpu.sync_copy(self.entering_ref.at[row, entry], self._entering_slots.at[j])

    def load(self) -> None:
        """Before the step: the entering states of every sequence one of its chunks starts."""
        if self.entering_ref is not None:
            self._transfer(self.starts_ref, outgoing=False)

    def store(self) -> None:
        """After the step: the leaving states of every sequence one of its chunks ends."""
        if self.leaving_ref is not None:
            self._transfer(self.ends_ref, outgoing=True)

    def _entering(self, j: int):
        """The entering states [K, V] (one per head) of slot j's sequence where chunk j starts one
        (stale elsewhere), or None without entering states."""
        if self.entering_ref is None:
            return None
        return [self._entering_slots[j, i] for i in range(self._entering_slots.shape[1])]

    def restart(self, j: int, states: list[jax.Array], clean: bool = False) -> list[jax.Array]:
        """The states [K, V] (one per head) chunk j of the step sees before its update: its
        sequence's entering states (or zero; with `clean`, non-finite entries read as 0) where it
        starts one, else `states`."""
        entering = self._entering(j)
        if entering is not None and clean:
            entering = [finite(state) for state in entering]
        return [
            jnp.where(self._starts(j, state.shape), 0.0 if entering is None else entering[i], state)
            for i, state in enumerate(states)
        ]

    def entering_started(self, j: int) -> list[jax.Array]:
        """The entering states [K, V] (one per head) of slot j's sequence where chunk j starts one,
        zeros elsewhere (its slot is stale there); none without entering states."""
        entering = self._entering(j)
        if entering is None:
            return []
        return [jnp.where(self._starts(j, state.shape), state, 0.0) for state in entering]

    def restart_finite(self, j: int, states: list[jax.Array], poisoned: list[jax.Array] | None):
        """`restart` with the entering states' non-finite entries read as 0, and the flags
        `poisoned` [1, V] (one per head, or None) restarted with them (`restart_flags`).
        Returns (states, flags)."""
        restarted = self.restart(j, states, clean=True)
        return restarted, None if poisoned is None else self.restart_flags(j, poisoned)

    def restart_flags(self, j: int, poisoned: list[jax.Array]) -> list[jax.Array]:
        """The flags `poisoned` [1, V] (one per head) after chunk j's restart: where it starts a
        sequence, 1 in the columns its entering state holds a non-finite entry in
        (`poison.nonfinite_columns`), else 0; elsewhere unchanged."""
        entering = self._entering(j)
        return [
            jnp.where(self._starts(j, flags.shape), 0.0 if entering is None else nonfinite_columns(entering[i]), flags)
            for i, flags in enumerate(poisoned)
        ]

    def _starts(self, j: int, shape):
        """bool `shape`: chunk j starts a sequence (a full vector: Mosaic selects no scalar masks)."""
        return jnp.full(shape, self.starts_ref[self.first_chunk + j], jnp.int32) == 1

    def keep(self, j: int, states: list[jax.Array]) -> None:
        """Puts `states` [K, V] (one per head, after chunk j's update) in slot j, for `store`."""
        if self.leaving_ref is not None:
            for i, state in enumerate(states):
                self._leaving_slots[j, i] = state
