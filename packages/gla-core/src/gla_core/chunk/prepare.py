"""XLA-side re-layout between the op's tensors and the chunk kernels' tensors.

The op uses `[B, T, H, D]`; the kernels use `[B, H, Tp, Dp]` with `Tp = NT * C` and `Dp`
the feature dim padded to 128 lanes (blocks that put H in the second-minor position do
not lower on TPU). Fixed-length inputs are zero-padded at the end of time; packed varlen
inputs (`B == 1`, `cu_seqlens`) are gathered into the padded per-sequence chunk layout of
`gla_core.varlen`, so every chunk belongs to one sequence. Padding steps carry zero q/k/v
and a zero log decay, so they change no state.

Gates stay per-step log decays `a_t` (float32, floored at `gates.GATE_FLOOR` so a hard reset
of -inf stays exact) in the chunk layout (a scalar gate as `[B, H, NT, 1, C]` rows for the
chunk-by-chunk kernels, or with 128 steps per row for the step kernels, see `ChunkSpecs`): the
kernels form every segment sum they exponentiate themselves (see `gates`), and return d/da.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gla_core import varlen
from gla_core.chunk.gates import floor_gates
from gla_core.tpu import NUM_LANES, pad_axis, round_up


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChunkMeta:
    """Per-chunk metadata, scalar-prefetched by the sequential kernels (int32 [NT] each).

    first: the chunk starts a sequence (reset the state to its initial state).
    last: the chunk ends a sequence (emit its final state).
    sequence: the owning sequence within its batch row (0 for fixed length; for varlen, where
      B == 1, the packed sequence). The chunk's per-sequence state is row
      `b * states_per_row + sequence` of the `[N, ...]` states (`ChunkSpecs.states_per_row`),
      so batch rows stay independent and a vmapped call can fold its mapped axis into B.
    """

    first: jax.Array
    last: jax.Array
    sequence: jax.Array


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static sizes of one call: the op's and the kernels'."""

    batch: int
    seq_len: int
    num_heads: int
    key_dim: int
    value_dim: int
    chunk: int
    num_chunks: int
    num_sequences: int | None  # N for varlen, else None
    step_chunks: int = 1  # the most chunks of a grid step, which a varlen layout is rounded for

    def chunk_layout(self, cu_seqlens: jax.Array) -> varlen.ChunkLayout | None:
        """The padded per-sequence layout of `cu_seqlens` [N+1] (`num_chunks` chunks), None for fixed length."""
        if not self.varlen:
            return None
        return varlen.build_chunk_layout(cu_seqlens, self.seq_len, self.chunk, self.step_chunks)

    @property
    def varlen(self) -> bool:
        return self.num_sequences is not None

    @property
    def padded_len(self) -> int:
        return self.num_chunks * self.chunk

    @property
    def padded_key_dim(self) -> int:
        return round_up(self.key_dim, NUM_LANES)

    @property
    def padded_value_dim(self) -> int:
        return round_up(self.value_dim, NUM_LANES)

    @property
    def states_per_row(self) -> int:
        """Per-sequence states of one batch row: N for varlen (B == 1), else 1."""
        return self.num_sequences if self.varlen else 1


def geometry(q, v, chunk: int, num_sequences: int | None, step_chunks: int = 1) -> Geometry:
    """The sizes of a call with q [B, T, H, K] and v [B, T, H, V]: fixed length, or `num_sequences`
    packed sequences laid out for grid steps of at most `step_chunks` chunks."""
    batch, seq_len, num_heads, key_dim = q.shape
    if num_sequences is None:
        num_chunks = max(1, -(-seq_len // chunk))
    else:
        num_chunks = varlen.num_padded_chunks(seq_len, num_sequences, chunk, step_chunks)
    dims = (batch, seq_len, num_heads, key_dim, v.shape[-1], chunk, num_chunks, num_sequences)
    return Geometry(*dims, step_chunks=step_chunks)


def chunk_meta(geo: Geometry, layout: varlen.ChunkLayout | None) -> ChunkMeta:
    """Metadata of fixed-length batches (one sequence per batch row) or of a varlen layout."""
    if layout is None:
        chunks = jnp.arange(geo.num_chunks, dtype=jnp.int32)
        first = (chunks == 0).astype(jnp.int32)
        last = (chunks == geo.num_chunks - 1).astype(jnp.int32)
        return ChunkMeta(first, last, jnp.zeros_like(chunks))
    return ChunkMeta(layout.chunk_first, layout.chunk_last, layout.chunk_sequence)


def _time_to_chunks(x, geo: Geometry, layout):
    """[B, T, ...] to [B, Tp, ...] (zero padding)."""
    if layout is not None:
        return varlen.to_chunks(x, layout)
    return pad_axis(x, 1, geo.padded_len)


def _time_from_chunks(y, geo: Geometry, layout):
    """[B, Tp, ...] to [B, T, ...]."""
    if layout is not None:
        return varlen.from_chunks(y, layout)
    return y[:, : geo.seq_len]


def to_kernel(x, geo: Geometry, layout, dtype=None):
    """[B, T, H, D] to kernel layout [B, H, Tp, Dp]."""
    x = x.astype(dtype) if dtype is not None else x
    x = _time_to_chunks(x, geo, layout)
    return pad_axis(jnp.swapaxes(x, 1, 2), 3, round_up(x.shape[-1], NUM_LANES))


def from_kernel(y, geo: Geometry, layout, width: int, dtype=None):
    """Kernel layout [B, H, Tp, Dp] to [B, T, H, width]."""
    y = jnp.swapaxes(y[..., :width], 1, 2)
    y = _time_from_chunks(y, geo, layout)
    return y.astype(dtype) if dtype is not None else y


def scalar_gate(a, geo: Geometry, layout):
    """Per-step log decay [B, T, H] to the kernels' [B, H, NT, 1, C] (float32, floored)."""
    a = _time_to_chunks(floor_gates(a.astype(jnp.float32)), geo, layout)
    return jnp.swapaxes(a, 1, 2).reshape(geo.batch, geo.num_heads, geo.num_chunks, 1, geo.chunk)


def broadcast_gate(a, geo: Geometry, layout, step_len: int):
    """Per-step log decay [B, T, H] to the step kernels' [B, H, Tp / L, L / 128, 128] ("broadcast"
    mode, L = `step_len` = n*C steps per grid step, a multiple of 128; float32, floored)."""
    a = _time_to_chunks(floor_gates(a.astype(jnp.float32)), geo, layout)
    return jnp.swapaxes(a, 1, 2).reshape(geo.batch, geo.num_heads, -1, step_len // NUM_LANES, NUM_LANES)


def broadcast_gate_grad(da, geo: Geometry, layout):
    """The kernels' d/da of a "broadcast" gate [B, H, Tp / L, L / 128, 128] to [B, T, H] (float32)."""
    return _time_from_chunks(jnp.swapaxes(da.reshape(geo.batch, geo.num_heads, -1), 1, 2), geo, layout)


def scalar_gate_grad(da, geo: Geometry, layout):
    """The kernels' d/da, partial sums per key tile [B, H, NK, NT, 1, C], to [B, T, H] (float32)."""
    da = jnp.sum(da, axis=2)
    da = jnp.swapaxes(da.reshape(geo.batch, geo.num_heads, geo.padded_len), 1, 2)
    return _time_from_chunks(da, geo, layout)


def key_gate(gk, geo: Geometry, layout):
    """Per-key log decay [B, T, H, K] to the kernels' [B, H, Tp, Kp] (float32, floored)."""
    return to_kernel(floor_gates(gk.astype(jnp.float32)), geo, layout)


def key_gate_grad(da, geo: Geometry, layout):
    """The kernels' d/da [B, H, Tp, Kp] to [B, T, H, K] (float32)."""
    return from_kernel(da, geo, layout, geo.key_dim)


def state_in(state, geo: Geometry):
    """[N, H, K, V] to the kernels' transposed, padded float32 [N, H, Vp, Kp]."""
    state = jnp.swapaxes(state.astype(jnp.float32), 2, 3)
    return pad_axis(pad_axis(state, 2, geo.padded_value_dim), 3, geo.padded_key_dim)


def state_out(state, geo: Geometry, dtype=jnp.float32):
    """The kernels' [N, H, Vp, Kp] back to [N, H, K, V]."""
    return jnp.swapaxes(state[:, :, : geo.value_dim, : geo.key_dim], 2, 3).astype(dtype)
