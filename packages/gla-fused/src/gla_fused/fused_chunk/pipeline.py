"""simple_gla on the fused kernels, forward and backward (one `jax.custom_vjp`).

Forward:  the op's arrays as free `[B, T*H, D]` views -> fused_chunk_fwd (all heads of a block of
          tokens per grid step, states in VMEM, o and the final state written in the op's layouts;
          when differentiated it also writes the state before every chunk).
Backward: fused_chunk_bwd (one kernel walking time backwards: dq, dk, dv, the initial-state
          gradient and per-token gate terms) -> the gate gradient in XLA (`backward.gate_gradient`).

Nothing is transposed or copied in HBM except the small gate rows (a free view for XLA's usual
layout of a [B, T, H] gate) and, when T or H must be padded (T not a multiple of the kernels'
block, an odd H with 16-bit inputs, an H that does not fill sublane tiles), the padded copies.
Packed varlen rows (B == 1, `cu_seqlens`) are gathered into the padded per-sequence chunk layout
of `gla_core.kit.varlen` (token-major: every chunk belongs to one sequence), the kernels restart
and emit the per-sequence states at the chunks its metadata marks, and the gradients come back
through the inverse gather (every token has exactly one slot). The transformation guards are those of the chunk
path: first-order autodiff only, `jax.vmap` folded into B, no kernel for calls without tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from gla_core.kit import (
    ChunkLayout,
    build_chunk_layout,
    define_chunk_vjp,
    empty_attention,
    floor_cumsum_gates,
    fold_vmap,
    from_chunks,
    gather_chunks,
    has_no_tokens,
    heads_per_group,
    merge_heads,
    num_padded_chunks,
    pad_axis,
    round_up,
    split_heads,
    to_chunks,
)
from gla_fused.fused_chunk.backward import BackwardGeometry, fused_chunk_bwd, gate_gradient
from gla_fused.fused_chunk.forward import ForwardGeometry, fused_chunk_fwd
from gla_fused.fused_chunk.steps import DEFAULT_BLOCK_TOKENS, DEFAULT_KERNEL_CHUNK, block_tokens_for

IMPLEMENTATION = "fused_chunk"
OP = "simple_gla"
COMPUTE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """Static facts of one call (the non-differentiable argument of the custom VJP).

    Attributes:
      batch, seq_len, num_heads, key_dim, value_dim: the op's sizes.
      scale: the query scale.
      output_final_state: return the final states.
      interpret: TPU interpret mode.
      kernel_chunk: C, the kernels' chunk.
      block_tokens: tokens per grid step, a multiple of C.
      dtypes: dtype name of every given array by its op keyword (gradients come back in them).
      num_sequences: N, the packed sequences of a varlen call (`cu_seqlens`), or None.
    """

    batch: int
    seq_len: int
    num_heads: int
    key_dim: int
    value_dim: int
    scale: float
    output_final_state: bool
    interpret: bool
    kernel_chunk: int
    block_tokens: int
    dtypes: tuple[tuple[str, str], ...]
    num_sequences: int | None = None

    @classmethod
    def create(
        cls,
        q,
        v,
        *,
        scale: float | None,
        output_final_state: bool,
        interpret: bool,
        kernel_chunk: int = DEFAULT_KERNEL_CHUNK,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        num_sequences: int | None = None,
        **arrays,
    ) -> FusedConfig:
        """The config of a call with q [B, T, H, K], v [B, T, H, V] and the other arrays by keyword
        (k, g, g_gamma, initial_state; None when absent). `block_tokens` is an upper bound;
        `num_sequences`: N for a packed varlen call."""
        batch, seq_len, num_heads, key_dim = q.shape
        arrays = dict(q=q, v=v, **arrays)
        walked = kernel_len(seq_len, kernel_chunk, num_sequences, max(1, block_tokens // kernel_chunk))
        return cls(
            batch=batch,
            seq_len=seq_len,
            num_heads=num_heads,
            key_dim=key_dim,
            value_dim=v.shape[-1],
            scale=float(key_dim**-0.5 if scale is None else scale),
            output_final_state=bool(output_final_state),
            interpret=bool(interpret),
            kernel_chunk=kernel_chunk,
            block_tokens=block_tokens_for(walked, kernel_chunk, block_tokens),
            dtypes=tuple(sorted((name, jnp.dtype(x.dtype).name) for name, x in arrays.items() if x is not None)),
            num_sequences=num_sequences,
        )

    def dtype_of(self, name: str) -> jnp.dtype:
        return jnp.dtype(dict(self.dtypes)[name])

    def has(self, name: str) -> bool:
        return name in dict(self.dtypes)

    @property
    def compute_dtype(self) -> jnp.dtype:
        """bfloat16 and float32 inputs compute as they are, other float dtypes in float32."""
        dtype = self.dtype_of("q")
        return dtype if dtype in COMPUTE_DTYPES else jnp.dtype(jnp.float32)

    @property
    def varlen(self) -> bool:
        return self.num_sequences is not None

    @property
    def padded_len(self) -> int:
        """Tokens the kernels walk per batch row (`kernel_len` rounded up to the grid step)."""
        walked = kernel_len(self.seq_len, self.kernel_chunk, self.num_sequences, self.block_chunks)
        return round_up(walked, self.block_tokens)

    @property
    def block_chunks(self) -> int:
        """Chunks per grid step (`create` chose it to divide a packed row's padded chunk count, which
        rounding for steps of at most this many therefore leaves as it is)."""
        return self.block_tokens // self.kernel_chunk

    def layout(self, cu_seqlens) -> ChunkLayout | None:
        """The padded per-sequence chunk layout of a varlen call (None for fixed length), of
        `padded_len` tokens."""
        if not self.varlen:
            return None
        return build_chunk_layout(cu_seqlens, self.seq_len, self.kernel_chunk, self.block_chunks)

    @property
    def padded_heads(self) -> int:
        """H rounded up to the kernels' head group (pairs for 16-bit inputs)."""
        return round_up(self.num_heads, heads_per_group(self.compute_dtype))

    def forward_geometry(self, *, has_h0: bool, has_states: bool) -> ForwardGeometry:
        return ForwardGeometry(
            num_heads=self.padded_heads,
            chunk=self.kernel_chunk,
            block_tokens=self.block_tokens,
            scale=self.scale,
            has_h0=has_h0,
            has_ht=self.output_final_state,
            has_states=has_states,
            mxu_dtype=self.compute_dtype,
            interpret=self.interpret,
            num_sequences=self.num_sequences,
        )

    def token_major(self, x, layout: ChunkLayout | None):
        """[B, T, H, D] to the kernels' [B, Tp*Hp, D] (a free view unless T or H is padded; varlen:
        gathered into `layout`, the padding steps left for the kernels to zero)."""
        x = x.astype(self.compute_dtype)
        if layout is not None:
            x = gather_chunks(x, layout)
        return merge_heads(pad_axis(pad_axis(x, 1, self.padded_len), 2, self.padded_heads))

    def from_token_major(self, y, dtype, layout: ChunkLayout | None):
        """The kernels' [B, Tp*Hp, D] back to [B, T, H, D] in `dtype`."""
        return self.from_time_major(split_heads(y, self.padded_heads)[:, :, : self.num_heads], layout).astype(dtype)

    def from_time_major(self, y, layout: ChunkLayout | None):
        """[B, Tp, ...] (the kernels' time axis) back to [B, T, ...]."""
        return from_chunks(y, layout) if layout is not None else y[:, : self.seq_len]

    def state_in(self, state):
        """[B, H, K, V] to the kernels' float32 [B, Hp, K, V]."""
        return pad_axis(state.astype(jnp.float32), 1, self.padded_heads)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FusedResiduals:
    """What the backward needs: the kernels' inputs and the state before every chunk.

    q, k: [B, Tp*Hp, K]; v: [B, Tp*Hp, V] (compute dtype, views of the op's arrays); gate:
    [B, Hp, Tp] float32; states: [B, NT, Hp, K, V] float32; h0: [B, Hp, K, V] float32 or None
    (varlen: [N, Hp, K, V]); layout: the varlen chunk layout or None.
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    gate: jax.Array
    states: jax.Array
    h0: jax.Array | None
    layout: ChunkLayout | None
    # Set by `define_chunk_vjp` when d g_gamma is asked for bfloat16 inputs (`BackwardGeometry`).
    float32_gate_grad: bool = dataclasses.field(default=False, metadata=dict(static=True))


def kernel_len(seq_len: int, chunk: int, num_sequences: int | None, step_chunks: int = 1) -> int:
    """Tokens of a batch row in the kernels' time layout: T, or for N packed sequences their padded
    per-sequence chunk layout (`gla_core.kit.num_padded_chunks` chunks of C, rounded up to split
    evenly into grid steps of at most `step_chunks` chunks)."""
    if num_sequences is None:
        return seq_len
    return num_padded_chunks(seq_len, num_sequences, chunk, step_chunks) * chunk


def _gate_rows(config: FusedConfig, g, g_gamma, layout: ChunkLayout | None):
    """The per-step log decay g + g_gamma as float32 rows [B, Hp, Tp], floored for the kernels'
    compensated cumsums (a free view of a [B, T, H] gate in XLA's usual layout for it; varlen:
    gathered into `layout`, padding steps a zero log decay)."""
    gate = jnp.zeros((config.batch, config.seq_len, config.num_heads), jnp.float32)
    if g is not None:
        gate = gate + g.astype(jnp.float32)
    if g_gamma is not None:
        gate = gate + g_gamma.astype(jnp.float32)
    gate = floor_cumsum_gates(gate)
    if layout is not None:
        gate = to_chunks(gate, layout)
    return pad_axis(pad_axis(jnp.swapaxes(gate, 1, 2), 2, config.padded_len), 1, config.padded_heads)


def _metadata(layout: ChunkLayout | None) -> tuple:
    """The kernels' per-chunk metadata arrays (first, last, sequence, length) of a varlen layout, else ()."""
    if layout is None:
        return ()
    return layout.chunk_first, layout.chunk_last, layout.chunk_sequence, layout.chunk_length


def _forward(config: FusedConfig, q, k, v, g, g_gamma, initial_state, cu_seqlens, *, keep_states: bool = True):
    layout = config.layout(cu_seqlens)
    h0 = None if initial_state is None else config.state_in(initial_state)
    views = (config.token_major(x, layout) for x in (q, k, v))
    residuals = FusedResiduals(*views, _gate_rows(config, g, g_gamma, layout), None, h0, layout)
    geo = config.forward_geometry(has_h0=h0 is not None, has_states=keep_states)
    meta = _metadata(layout)

    def launch(q, k, v, gate, h0, *meta):
        return fused_chunk_fwd(q, k, v, gate, h0, meta or None, geo=geo)

    arrays = (residuals.q, residuals.k, residuals.v, residuals.gate, h0, *meta)
    o, ht, states = fold_vmap(launch, arrays, in_axes=(0,) * 5 + (None,) * len(meta), out_axes=0)
    o = config.from_token_major(o, v.dtype, layout)
    if ht is not None:
        ht = ht[:, : config.num_heads]
        ht = layout.pass_through_empty(ht, initial_state) if layout is not None else ht
    return (o, ht), dataclasses.replace(residuals, states=states)


def _backward(config: FusedConfig, x: FusedResiduals, cotangents):
    do, dht = cotangents
    geo = BackwardGeometry(
        config.forward_geometry(has_h0=x.h0 is not None, has_states=True),
        has_dht=dht is not None,
        has_dh0=x.h0 is not None,
        split_state_products=x.float32_gate_grad,
    )
    meta = _metadata(x.layout)

    def launch(q, k, v, do, gate, states, dht, *meta):
        return fused_chunk_bwd(q, k, v, do, gate, states, dht, meta or None, geo=geo)

    dhtk = config.state_in(dht) if dht is not None else None
    arrays = (x.q, x.k, x.v, config.token_major(do, x.layout), x.gate, x.states, dhtk, *meta)
    dq, dk, dv, terms, dh0 = fold_vmap(launch, arrays, in_axes=(0,) * 7 + (None,) * len(meta), out_axes=0)
    da = gate_gradient(terms, x.gate, config.kernel_chunk)[:, : config.num_heads]
    da = config.from_time_major(jnp.swapaxes(da, 1, 2), x.layout)  # [B, T, H]
    dg = da.astype(config.dtype_of("g")) if config.has("g") else None
    dg_gamma = jnp.sum(da, axis=(0, 1)).astype(config.dtype_of("g_gamma")) if config.has("g_gamma") else None
    d_initial = None
    if dh0 is not None:
        d_initial = dh0[:, : config.num_heads]
        if x.layout is not None:
            d_initial = x.layout.pass_through_empty(d_initial, dht)
        d_initial = d_initial.astype(config.dtype_of("initial_state"))
    return (
        config.from_token_major(dq, config.dtype_of("q"), x.layout),
        config.from_token_major(dk, config.dtype_of("k"), x.layout),
        config.from_token_major(dv, config.dtype_of("v"), x.layout),
        dg,
        dg_gamma,
        d_initial,
        None,  # cu_seqlens
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_attention(config, q, k, v, g, g_gamma, initial_state, cu_seqlens):
    return _forward(config, q, k, v, g, g_gamma, initial_state, cu_seqlens, keep_states=False)[0]


define_chunk_vjp(_fused_attention, _forward, _backward, implementation=IMPLEMENTATION, op=OP, g_gamma_argnum=5)


def fused_chunk_attention(
    q,
    k,
    v,
    *,
    g=None,
    g_gamma=None,
    scale: float | None = None,
    initial_state=None,
    output_final_state: bool = False,
    kernel_chunk: int = DEFAULT_KERNEL_CHUNK,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    cu_seqlens=None,
    interpret: bool = False,
):
    """simple_gla on the fused Pallas TPU kernels (fixed length or packed varlen).

    `S_t = e^{a_t} S_{t-1} + k_t v_t^T`, `o_t = scale * q_t^T S_t`, with the per-step log
    decay `a_t = g_t + g_gamma` (either or both may be absent). Arguments are already
    validated (see `gla_core.validation`).

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V] (bfloat16 or float32; other float dtypes are
        computed in float32).
      g: [B, T, H] or None; g_gamma: [H] or None.
      scale: multiplies q; None means K ** -0.5.
      initial_state: [N, H, K, V] or None (N = B, or the number of sequences with cu_seqlens).
      output_final_state: also return the final states [N, H, K, V] float32.
      kernel_chunk: the kernels' chunk (16, 32, 64, 128 or 256). The op's `chunk_size` does not
        apply: every chunk size computes the same function up to rounding, and this one is a
        tuning knob of these kernels (see `steps`).
      block_tokens: tokens per grid step, at most.
      cu_seqlens: int32 [N+1] packed sequence boundaries (B == 1), may be traced.
      interpret: run the kernels in TPU interpret mode.

    Returns:
      (o [B, T, H, V] in v's dtype, final_state or None). Differentiable in q, k, v, g,
      g_gamma and initial_state.

    Example:
      >>> o, ht = fused_chunk_attention(q, k, v, g=g, output_final_state=True, interpret=True)
    """
    num_sequences = None if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if has_no_tokens(q):
        num_states = q.shape[0] if num_sequences is None else num_sequences
        return empty_attention(
            q, v, initial_state=initial_state, num_states=num_states, output_final_state=output_final_state
        )
    config = FusedConfig.create(
        q,
        v,
        scale=scale,
        output_final_state=output_final_state,
        interpret=interpret,
        kernel_chunk=kernel_chunk,
        block_tokens=block_tokens,
        num_sequences=num_sequences,
        k=k,
        g=g,
        g_gamma=g_gamma,
        initial_state=initial_state,
    )
    o, final_state = _fused_attention(config, q, k, v, g, g_gamma, initial_state, cu_seqlens)
    return o, (final_state if output_final_state else None)
