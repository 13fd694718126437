"""XLA side of the kda chunk kernels: the kernel layout of the inputs, and back.

Kernels see `[B, H, Tp, Dp]` (heads before time: a block squeezing H in the second-minor
position would not lower), Tp a multiple of the chunk size C and Dp a multiple of 128 lanes,
every padded element exactly zero (zero k, q, v, beta and log decay contribute nothing and
leave the state unchanged). Packed varlen input is first re-laid out by
`gla_core.varlen` so each chunk holds tokens of one sequence. Everything here is plain,
differentiable `jnp`; gathers happen here, never in kernels.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gla_core.kit import NUM_LANES, ChunkLayout, build_chunk_layout, from_chunks, pad_axis, round_up, to_chunks


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChunkMeta:
    """Per-chunk metadata scalar-prefetched by the sequential kernels (int32).

    first/last: [NT] 1 where the chunk starts/ends its sequence; seq: [NT] index of the
    chunk's sequence relative to the batch row (0 when not varlen); empty: [N] 1 for a
    sequence without tokens (its final state is its initial state; kernels never visit it).
    """

    first: jax.Array
    last: jax.Array
    seq: jax.Array
    empty: jax.Array


@dataclasses.dataclass(frozen=True)
class KernelLayout:
    """How packed `[B, T, H, D]` tensors map to the kernel layout `[B, H, Tp, Dp]`."""

    seq_len: int
    chunk_size: int
    num_chunks: int
    key_dim: int
    value_dim: int
    varlen: ChunkLayout | None

    @property
    def padded_len(self) -> int:
        return self.num_chunks * self.chunk_size

    @property
    def key_pad(self) -> int:
        return round_up(self.key_dim, NUM_LANES)

    @property
    def value_pad(self) -> int:
        return round_up(self.value_dim, NUM_LANES)


def make_layout(seq_len: int, key_dim: int, value_dim: int, chunk_size: int, cu_seqlens=None) -> KernelLayout:
    """The kernel layout for a (possibly packed varlen) input of T = `seq_len` tokens."""
    if cu_seqlens is None:
        return KernelLayout(seq_len, chunk_size, -(-seq_len // chunk_size), key_dim, value_dim, None)
    varlen = build_chunk_layout(cu_seqlens, seq_len, chunk_size)
    return KernelLayout(seq_len, chunk_size, varlen.num_chunks, key_dim, value_dim, varlen)


def chunk_meta(layout: KernelLayout, batch: int) -> ChunkMeta:
    """Metadata of every chunk: one sequence per batch row, or the packed sequences."""
    if layout.varlen is None:
        chunks = jnp.arange(layout.num_chunks, dtype=jnp.int32)
        return ChunkMeta(
            first=(chunks == 0).astype(jnp.int32),
            last=(chunks == layout.num_chunks - 1).astype(jnp.int32),
            seq=jnp.zeros_like(chunks),
            empty=jnp.zeros((batch,), jnp.int32),
        )
    varlen = layout.varlen
    return ChunkMeta(
        first=varlen.chunk_first,
        last=varlen.chunk_last,
        seq=varlen.chunk_sequence,
        empty=varlen.empty_sequence.astype(jnp.int32),
    )


def to_kernel(x, layout: KernelLayout, dim_pad: int | None):
    """[B, T, H, D] -> [B, H, Tp, Dp] (`dim_pad` None: no feature axis, [B, T, H] -> [B, H, Tp])."""
    x = pad_axis(x, 1, layout.padded_len) if layout.varlen is None else to_chunks(x, layout.varlen)
    x = jnp.swapaxes(x, 1, 2)
    return x if dim_pad is None else pad_axis(x, -1, dim_pad)


def from_kernel(y, layout: KernelLayout, dim: int):
    """[B, H, Tp, Dp] -> [B, T, H, D]."""
    y = jnp.swapaxes(y[..., :dim], 1, 2)
    if layout.varlen is not None:
        return from_chunks(y, layout.varlen)
    return y[:, : layout.seq_len]


def local_cumsum(g, sub_chunk: int):
    """Inclusive cumsum along time of g [B, H, Tp, K] (float32), restarting every `sub_chunk` steps.

    Returns (hi, lo), both [B, H, Tp, K] float32: the cumsum as an unevaluated sum hi + lo,
    hi the running float32 sum and lo the accumulated rounding error of its additions (TwoSum,
    exact), so differences of the cumsum stay accurate (`chunk_math.Decays`).
    """
    batch, heads, padded_len, key_dim = g.shape
    steps = jnp.moveaxis(g.reshape(batch, heads, padded_len // sub_chunk, sub_chunk, key_dim), 3, 0)
    hi = lo = jnp.zeros(steps.shape[1:], g.dtype)
    his, los = [], []
    for step in steps:
        total = hi + step
        back = total - hi
        lo = lo + ((hi - (total - back)) + (step - back))
        hi = total
        his.append(hi)
        los.append(lo)
    return tuple(jnp.stack(parts, axis=3).reshape(g.shape) for parts in (his, los))


def beta_blocks(beta, chunk_size: int):
    """beta [B, HV, Tp] -> [B, HV, NT, 1, C]: one lane-dense row per chunk."""
    batch, heads, padded_len = beta.shape
    return beta.reshape(batch, heads, padded_len // chunk_size, 1, chunk_size)


def pad_state(state, layout: KernelLayout):
    """[N, HV, K, V] -> [N, HV, Kp, Vp] float32."""
    state = pad_axis(state.astype(jnp.float32), 2, layout.key_pad)
    return pad_axis(state, 3, layout.value_pad)


def unpad_state(state, layout: KernelLayout):
    return state[:, :, : layout.key_dim, : layout.value_dim]
