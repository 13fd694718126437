"""Chunk-major layout shared by the `xla` and `recurrent` kda implementations.

`ChunkedInputs.build` lays packed `[B, T, HV, D]` tensors out as `[NT, B*HV, C, D]`: the
sequence axis cut into NT chunks of C steps (zero padded at the end), batch and heads merged
into one axis. With `cu_seqlens` (B == 1) it uses `gla_core.varlen`, so every chunk belongs
to one sequence, chunks carry "first of its sequence" flags and sequence ids, and the number
of chunks depends only on (T, N, C): no recompile when only the boundaries change.

Batch and head axes are merged on purpose: XLA:CPU (jax 0.10.2) miscompiles the gradients of
some einsums whose several batch axes include a size-1 axis (the process segfaults), so the
kda implementations keep one batch axis in every batched product.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gla_core.kit import ChunkLayout, build_chunk_layout, from_chunks, to_chunks


def flat(x):
    """Merges the two leading axes: [NT, BH, ...] -> [NT*BH, ...]."""
    return x.reshape((-1, *x.shape[2:]))


def _to_chunk_major(x, num_chunks: int, chunk_size: int):
    """[B, NT*C, HV, D] -> [NT, B*HV, C, D]."""
    batch, _, heads, dim = x.shape
    x = x.reshape(batch, num_chunks, chunk_size, heads, dim).transpose(1, 0, 3, 2, 4)
    return x.reshape(num_chunks, batch * heads, chunk_size, dim)


@dataclasses.dataclass(frozen=True)
class ChunkGrid:
    """How a [B, T, HV, ...] problem is cut into chunks.

    batch, seq_len, heads: B, T, HV of the packed input; chunk_size: C; num_chunks: NT.
    layout: the varlen `ChunkLayout` (None without cu_seqlens).
    """

    batch: int
    seq_len: int
    heads: int
    chunk_size: int
    num_chunks: int
    layout: ChunkLayout | None

    @classmethod
    def build(cls, batch: int, seq_len: int, heads: int, chunk_size: int, cu_seqlens=None) -> ChunkGrid:
        if cu_seqlens is None:
            return cls(batch, seq_len, heads, chunk_size, max(1, -(-seq_len // chunk_size)), None)
        layout = build_chunk_layout(cu_seqlens, seq_len, chunk_size)
        return cls(batch, seq_len, heads, chunk_size, layout.num_chunks, layout)

    @property
    def varlen(self) -> bool:
        return self.layout is not None

    def to_chunks(self, x):
        """[B, T, HV, D] -> [NT, B*HV, C, D] (padding slots zero)."""
        if self.layout is None:
            x = jnp.pad(x, ((0, 0), (0, self.num_chunks * self.chunk_size - self.seq_len), (0, 0), (0, 0)))
        else:
            x = to_chunks(x, self.layout)
        return _to_chunk_major(x, self.num_chunks, self.chunk_size)

    def to_chunks_together(self, arrays):
        """Several [B, T, HV, D_i] arrays -> [NT, B*HV, C, D_i] each, through one layout pass.

        Concatenating along the feature axis first means one gather (one scatter in the
        backward) instead of one per array.
        """
        sizes = [x.shape[-1] for x in arrays]
        chunked = self.to_chunks(jnp.concatenate(arrays, axis=-1))
        return jnp.split(chunked, np.cumsum(sizes)[:-1].tolist(), axis=-1)

    def from_chunks(self, y):
        """[NT, B*HV, C, D] -> [B, T, HV, D] (padding slots dropped)."""
        _, _, chunk, dim = y.shape
        y = y.reshape(self.num_chunks, self.batch, self.heads, chunk, dim).transpose(1, 0, 3, 2, 4)
        y = y.reshape(self.batch, self.num_chunks * chunk, self.heads, dim)
        return y[:, : self.seq_len] if self.layout is None else from_chunks(y, self.layout)

    def chunk_flags(self):
        """([NT] int32 1 where a chunk starts a sequence, [NT] int32 sequence id); zeros without varlen."""
        if self.layout is None:
            zeros = jnp.zeros((self.num_chunks,), jnp.int32)
            return zeros, zeros
        return self.layout.chunk_first, self.layout.chunk_sequence

    def last_chunks(self):
        """[N] index of the last chunk of every sequence (varlen; clipped, meaningless for empty ones)."""
        layout = self.layout
        chunks = (layout.sequence_length + layout.chunk_size - 1) // layout.chunk_size
        return jnp.clip(jnp.cumsum(chunks) - 1, 0, layout.num_chunks - 1)

    def empty_sequences(self):
        """[N, 1, 1, 1] bool: the sequence has no token (varlen)."""
        return self.layout.empty_sequence[:, None, None, None]


def select_initial_state(state, initial_state, first, sequence):
    """The state entering a chunk: `initial_state[sequence]` [HV, K, V] when `first`, else `state` [HV, K, V]."""
    return jnp.where(first > 0, initial_state[sequence], state)


def zero_state(num_states: int, heads: int, key_dim: int, value_dim: int, dtype) -> jax.Array:
    """[N, HV, K, V] zeros: the initial state when none is given."""
    return jnp.zeros((num_states, heads, key_dim, value_dim), dtype)
