"""Chunked layout of the inputs, shared by the `xla` and `recurrent` implementations.

Both implementations work on chunks `[Bp, NT, C, H, X]` in which every chunk belongs to one
sequence, and carry a state `[Bp, H, K, V]` from chunk to chunk:

- fixed length: `Bp = B` rows, each one sequence; T is zero-padded to `NT * C`.
- varlen (`cu_seqlens` [N+1], B == 1): `Bp = 1`; `gla_core.varlen` re-lays the packed tokens so
  each sequence starts on a chunk boundary. `NT` depends only on (T, N, C), so changing only
  the boundaries under `jax.jit` does not recompile.

Padding slots hold zeros in every input, including the log decay: a zero key and a zero
decay leave the state unchanged, so the state after a sequence's last chunk is its final
state. `Segments` carries the per-chunk bookkeeping (state resets, final states) into the
implementations' `custom_vjp` cores.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gla_core.kit import varlen


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segments:
    """Which sequence each chunk belongs to, for state resets and final states.

    Attributes:
      varlen: static; False for fixed-length rows (sequence n is batch row n).
      first: [NT] bool, the chunk starts its sequence (its state is the initial state).
      last: [NT] bool, the chunk ends its sequence (the state after it is the final state).
      sequence: [NT] int32 sequence of each chunk (varlen only; zeros otherwise).
      empty: [N] bool, the sequence has no token (its final state is its initial state).
    """

    varlen: bool = dataclasses.field(metadata=dict(static=True))
    first: jax.Array
    last: jax.Array
    sequence: jax.Array
    empty: jax.Array

    def state_for_chunk(self, per_sequence: jax.Array, sequence: jax.Array) -> jax.Array:
        """The `[Bp, H, K, V]` slice of a per-sequence state `[N, H, K, V]` for one chunk."""
        if not self.varlen:
            return per_sequence
        return jax.lax.dynamic_index_in_dim(per_sequence, sequence, axis=0, keepdims=True)

    def final_states(self, after: jax.Array, initial: jax.Array | None) -> jax.Array:
        """Final states `[N, H, K, V]` from the states after every chunk `[NT, Bp, H, K, V]` and the
        initial states `[N, H, K, V]` (None: zeros)."""
        if not self.varlen:
            return after[-1]
        owned = jnp.where(self.last[:, None, None, None], after[:, 0], 0.0)
        final = jax.ops.segment_sum(owned, self.sequence, num_segments=self.empty.shape[0])
        return jnp.where(self.empty[:, None, None, None], 0.0 if initial is None else initial, final)

    def initial_state_grad(self, d_before: jax.Array, d_final: jax.Array) -> jax.Array:
        """Gradient `[N, H, K, V]` of the initial states from the gradients of the states entering
        every chunk `[NT, Bp, H, K, V]` and of the final states `[N, H, K, V]`."""
        if not self.varlen:
            return d_before[0]
        owned = jnp.where(self.first[:, None, None, None], d_before[:, 0], 0.0)
        grad = jax.ops.segment_sum(owned, self.sequence, num_segments=self.empty.shape[0])
        return grad + jnp.where(self.empty[:, None, None, None], d_final, 0.0)


@dataclasses.dataclass(frozen=True)
class ChunkedSequences:
    """How `[B, T, ...]` inputs map to chunks `[Bp, NT, C, ...]` and back (see the module doc)."""

    batch: int
    total_len: int
    chunk_size: int
    num_chunks: int
    layout: varlen.ChunkLayout | None

    @property
    def varlen(self) -> bool:
        return self.layout is not None

    def split(self, x: jax.Array) -> jax.Array:
        """`[B, T, ...]` to `[Bp, NT, C, ...]`, padding slots zero."""
        c, nt = self.chunk_size, self.num_chunks
        if self.layout is not None:
            x = varlen.to_chunks(x, self.layout)
        else:
            widths = [(0, 0), (0, nt * c - self.total_len)] + [(0, 0)] * (x.ndim - 2)
            x = jnp.pad(x, widths)
        return x.reshape(x.shape[0], nt, c, *x.shape[2:])

    def merge(self, y: jax.Array) -> jax.Array:
        """`[Bp, NT, C, ...]` back to `[B, T, ...]` (padding slots dropped)."""
        y = y.reshape(y.shape[0], self.num_chunks * self.chunk_size, *y.shape[3:])
        if self.layout is not None:
            return varlen.from_chunks(y, self.layout)
        return y[:, : self.total_len]

    def segments(self) -> Segments:
        nt = self.num_chunks
        if self.layout is None:
            chunk = jnp.arange(nt)
            return Segments(
                varlen=False,
                first=chunk == 0,
                last=chunk == nt - 1,
                sequence=jnp.zeros((nt,), jnp.int32),
                empty=jnp.zeros((self.batch,), bool),
            )
        return Segments(
            varlen=True,
            first=self.layout.chunk_first.astype(bool),
            last=self.layout.chunk_last.astype(bool),
            sequence=self.layout.chunk_sequence,
            empty=self.layout.empty_sequence,
        )


def chunk_sequences(batch: int, total_len: int, chunk_size: int, cu_seqlens: jax.Array | None) -> ChunkedSequences:
    """The chunked layout of `batch` rows of `total_len` tokens, or of packed `cu_seqlens` [N+1]."""
    if cu_seqlens is None:
        num_chunks = max(1, -(-total_len // chunk_size))
        return ChunkedSequences(batch, total_len, chunk_size, num_chunks, None)
    layout = varlen.build_chunk_layout(cu_seqlens, total_len, chunk_size)
    return ChunkedSequences(batch, total_len, chunk_size, layout.num_chunks, layout)
