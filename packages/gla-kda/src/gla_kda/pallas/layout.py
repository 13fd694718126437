"""XLA side of the kda chunk kernels: the kernel layout of the inputs, and back.

The kernels, forward and backward, read q, k, v, g, dO and write o and the gradients of q, k,
v and g token-major, `[B, Tp, H*Dp]`: a reshape of
the user's `[B, T, H, D]` array when T is a multiple of the chunk size C, D of 128 lanes and
the input is not packed varlen; a head's Dp lanes are one block (`config.token_block`). On
TPU the reshape is not free for bfloat16: XLA tiles the last two dims, (H, D) before and
(T, H*D) after, so it is one relayout copy (measured in the compiled forward), still no
transpose to `[B, H, T, D]`. Otherwise the view is padded with zeros to Tp = NT * C tokens
and Dp lanes per head (zero k, q, v, beta and log decay contribute nothing and leave the state
unchanged), and packed varlen input is first re-laid out by `gla_core.varlen` so each chunk
holds tokens of one sequence. beta and the kernels' own per-chunk intermediates (Tinv, Aqk) use
the head-major `[B, H, Tp, ...]` layout. Everything here is plain, differentiable `jnp`;
gathers happen here, never in kernels.
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


def make_layout(
    seq_len: int, key_dim: int, value_dim: int, chunk_size: int, cu_seqlens=None, step_chunks: int = 1
) -> KernelLayout:
    """The kernel layout for a (possibly packed varlen) input of T = `seq_len` tokens; packed
    sequences are laid out for grid steps of at most `step_chunks` chunks (`build_chunk_layout`)."""
    if cu_seqlens is None:
        return KernelLayout(seq_len, chunk_size, -(-seq_len // chunk_size), key_dim, value_dim, None)
    varlen = build_chunk_layout(cu_seqlens, seq_len, chunk_size, step_chunks)
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


def _to_slots(x, layout: KernelLayout):
    """[B, T, ...] -> [B, Tp, ...]: zero-padded, or varlen's chunk slots."""
    return pad_axis(x, 1, layout.padded_len) if layout.varlen is None else to_chunks(x, layout.varlen)


def to_tokens(x, layout: KernelLayout, dim_pad: int):
    """[B, T, H, D] -> token-major [B, Tp, H*Dp] (a reshape when Tp = T, Dp = D and not varlen).

    The rows move to their slots after the reshape: a gather of whole [H*Dp] rows that XLA fuses
    with the slot mask, instead of a gather of [H, Dp] tiles then a relayout of its result."""
    x = pad_axis(x, 3, dim_pad)
    return _to_slots(x.reshape(x.shape[0], x.shape[1], -1), layout)


def from_tokens(y, layout: KernelLayout, heads: int, dim: int):
    """Token-major [B, Tp, H*Dp] -> [B, T, H, D] (whole rows gathered back before the reshape)."""
    y = y[:, : layout.seq_len] if layout.varlen is None else from_chunks(y, layout.varlen)
    return y.reshape(y.shape[0], y.shape[1], heads, -1)[..., :dim]


def beta_to_kernel(beta, layout: KernelLayout):
    """beta [B, T, HV] -> [B, HV, NT, 1, C]: one lane-dense row per chunk (a small transpose)."""
    beta = jnp.swapaxes(_to_slots(beta, layout), 1, 2)
    batch, heads, padded_len = beta.shape
    return beta.reshape(batch, heads, padded_len // layout.chunk_size, 1, layout.chunk_size)


def pad_state(state, layout: KernelLayout):
    """[N, HV, K, V] -> [N, HV, Kp, Vp] float32."""
    state = pad_axis(state.astype(jnp.float32), 2, layout.key_pad)
    return pad_axis(state, 3, layout.value_pad)


def unpad_state(state, layout: KernelLayout):
    return state[:, :, : layout.key_dim, : layout.value_dim]
