"""Packed variable-length sequences as a per-sequence chunk layout.

Kernels want every chunk to belong to one sequence. `build_chunk_layout` maps the packed
tokens `[1, T, ...]` described by a (possibly traced) `cu_seqlens` [N+1] onto a padded
layout of `num_chunks` chunks where each sequence starts on a chunk boundary:

    packed   | s0 s0 s0 s0 s0 | s1 s1 | s2 ...            (T tokens)
    padded   | s0 s0 s0 s0 | s0 -- -- -- | s1 s1 -- -- | s2 ...   (num_chunks * C slots)

`num_chunks` is `(T + N * (C - 1)) // C` (at most T), the worst case of any boundaries, rounded up so that
it splits evenly into the fewest grid steps of at most the kernels' chunks per step
(`even_step_chunks`). It depends only on T, N, C and that step size, never on the
boundaries, so under `jax.jit` changing only the boundaries does not recompile. Chunks
past the last sequence are empty padding. Gathers happen here, in XLA, never in kernels.
Empty (length-0) sequences own no chunk: callers keep their state unchanged
(`empty_sequence`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """Where every packed token goes in the padded chunk layout, and per-chunk metadata.

    Static fields:
      chunk_size: C.
      num_chunks: NT, number of chunks of the padded layout.
      total_len: T, number of packed tokens.

    Arrays (int32 unless noted), all traced-friendly:
      chunk_sequence: [NT] sequence id of each chunk (N - 1 for padding chunks).
      chunk_first: [NT] 1 if the chunk is the first of its sequence (reset the state).
      chunk_last: [NT] 1 if the chunk is the last of its sequence (emit the final state).
      chunk_length: [NT] valid tokens in the chunk (0 for padding chunks).
      slot_source: [NT * C] packed token index of each padded slot (0 where invalid).
      slot_valid: [NT * C] bool, the slot holds a real token.
      token_slot: [T] padded slot of each packed token.
      sequence_length: [N] length of each sequence.
    """

    chunk_size: int = dataclasses.field(metadata=dict(static=True))
    num_chunks: int = dataclasses.field(metadata=dict(static=True))
    total_len: int = dataclasses.field(metadata=dict(static=True))
    chunk_sequence: jax.Array
    chunk_first: jax.Array
    chunk_last: jax.Array
    chunk_length: jax.Array
    slot_source: jax.Array
    slot_valid: jax.Array
    token_slot: jax.Array
    sequence_length: jax.Array

    @property
    def num_sequences(self) -> int:
        return self.sequence_length.shape[0]

    @property
    def padded_len(self) -> int:
        return self.num_chunks * self.chunk_size

    @property
    def empty_sequence(self) -> jax.Array:
        """[N] bool: the sequence has no token (its final state is its initial state)."""
        return self.sequence_length == 0

    def pass_through_empty(self, states: jax.Array, passed: jax.Array | None) -> jax.Array:
        """Per-sequence float32 states `[N, ...]` written by kernels, with the entry of an empty
        sequence (which no kernel writes) replaced by `passed` [N, ...]: what enters it leaves it (its
        initial state as its final state, its final-state gradient as its initial-state gradient;
        None: zero)."""
        passed = jnp.zeros_like(states) if passed is None else passed.astype(states.dtype)
        empty = self.empty_sequence.reshape((-1,) + (1,) * (states.ndim - 1))
        return jnp.where(empty, passed, states)


def num_padded_chunks(total_len: int, num_sequences: int, chunk_size: int, step_chunks: int = 1) -> int:
    """The most chunks, sum(ceil(len_n / C)), any partition of T tokens into N sequences takes, rounded
    up for grid steps of at most `step_chunks` chunks (`even_step_chunks`).

    Each ceil(len_n / C) is at most (len_n + C - 1) / C, so the sum is at most (T + N (C - 1)) / C and,
    being whole, at most its floor; N - 1 sequences of one token and one of the rest take exactly
    that many. With fewer tokens than N - 1 the worst is one chunk per token."""
    worst = max(1, min(total_len, (total_len + num_sequences * (chunk_size - 1)) // chunk_size))
    return even_step_chunks(worst, step_chunks)


def even_step_chunks(num_chunks: int, step_chunks: int) -> int:
    """The fewest chunks >= `num_chunks` that split evenly into the fewest grid steps of at most
    `step_chunks` chunks each (fewer than one padding chunk per step).

    The kernels take a divisor of the chunk count per grid step, and the worst case of packed
    sequences is often a poor one (T / C + N - 1: 67 chunks at T = 8192, C = 128, N = 4, a prime:
    one chunk per step). Each grid step costs a fixed overhead and overlaps less of its work, so
    67 steps of one chunk (or 17 of 4) take longer than 9 steps of 8 with 5 padding chunks.
    """
    steps = -(-num_chunks // step_chunks)
    return steps * -(-num_chunks // steps)


def build_chunk_layout(cu_seqlens: jax.Array, total_len: int, chunk_size: int, step_chunks: int = 1) -> ChunkLayout:
    """Builds the padded per-sequence chunk layout for `cu_seqlens` [N+1] (int32, may be traced),
    of `num_padded_chunks(total_len, N, chunk_size, step_chunks)` chunks."""
    cu = cu_seqlens.astype(jnp.int32)
    n = cu.shape[0] - 1
    c = chunk_size
    nt = num_padded_chunks(total_len, n, c, step_chunks)
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    chunks_per_sequence = (lengths + c - 1) // c
    chunk_end = jnp.cumsum(chunks_per_sequence)  # exclusive end chunk of each sequence
    chunk_begin = chunk_end - chunks_per_sequence
    used_chunks = chunk_end[-1]

    chunk_ids = jnp.arange(nt, dtype=jnp.int32)
    # The sequence owning chunk j is the first one whose chunk range ends after j.
    owner = jnp.sum(chunk_end[None, :] <= chunk_ids[:, None], axis=1).astype(jnp.int32)
    is_real = chunk_ids < used_chunks
    owner = jnp.where(is_real, jnp.minimum(owner, n - 1), n - 1)
    local_chunk = chunk_ids - chunk_begin[owner]
    chunk_length = jnp.where(is_real, jnp.clip(lengths[owner] - local_chunk * c, 0, c), 0).astype(jnp.int32)
    chunk_first = (is_real & (local_chunk == 0)).astype(jnp.int32)
    chunk_last = (is_real & (local_chunk == chunks_per_sequence[owner] - 1)).astype(jnp.int32)

    offsets = jnp.arange(c, dtype=jnp.int32)
    slot_valid = (offsets[None, :] < chunk_length[:, None]).reshape(-1)
    slot_source = (starts[owner][:, None] + local_chunk[:, None] * c + offsets[None, :]).reshape(-1)
    slot_source = jnp.where(slot_valid, slot_source, 0).astype(jnp.int32)

    tokens = jnp.arange(total_len, dtype=jnp.int32)
    token_sequence = jnp.clip(jnp.searchsorted(cu, tokens, side="right") - 1, 0, n - 1)
    token_slot = (chunk_begin[token_sequence] * c + tokens - starts[token_sequence]).astype(jnp.int32)

    return ChunkLayout(
        chunk_size=c,
        num_chunks=nt,
        total_len=total_len,
        chunk_sequence=owner,
        chunk_first=chunk_first,
        chunk_last=chunk_last,
        chunk_length=chunk_length,
        slot_source=slot_source,
        slot_valid=slot_valid,
        token_slot=token_slot,
        sequence_length=lengths.astype(jnp.int32),
    )


def gather_chunks(x: jax.Array, layout: ChunkLayout) -> jax.Array:
    """Packed `[1, T, ...]` to padded `[1, NT * C, ...]`, padding slots holding other tokens of `x`
    (one gather; for kernels that zero the padding steps themselves by `chunk_length`: on TPU, XLA
    zeroes them in a second pass over the whole array, see `to_chunks`)."""
    if x.shape[1] == 0:  # only empty sequences: every slot is padding
        return jnp.zeros((1, layout.padded_len, *x.shape[2:]), x.dtype)
    # every slot_source is in bounds; "fill" (take's default) would add a select over the whole result
    return jnp.take(x[0], layout.slot_source, axis=0, mode="clip")[None]


def to_chunks(x: jax.Array, layout: ChunkLayout) -> jax.Array:
    """Packed `[1, T, ...]` to padded `[1, NT * C, ...]`; padding slots are zero."""
    mask = layout.slot_valid.reshape((1, -1) + (1,) * (x.ndim - 2))
    return jnp.where(mask, gather_chunks(x, layout), jnp.zeros((), x.dtype))


def from_chunks(y: jax.Array, layout: ChunkLayout) -> jax.Array:
    """Padded `[1, NT * C, ...]` back to packed `[1, T, ...]` (padding slots dropped)."""
    return jnp.take(y[0], layout.token_slot, axis=0, mode="clip")[None]  # slots in bounds
