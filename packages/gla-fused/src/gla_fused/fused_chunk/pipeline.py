"""simple_gla on the fused kernels, with its split backward (one `jax.custom_vjp`).

Forward:  the op's arrays as free `[B, T*H, D]` views -> fused_chunk_fwd (all heads of a block of
          tokens per grid step, states in VMEM, o and the final state written in the op's layouts).
Backward: prepare do -> chunk_fwd_h (recomputes the state before every chunk) ->
          fused_chunk_bwd_dhdv (pass 1, sequential backwards: dv, dh, dh0) ->
          chunk_bwd_dqkg (pass 2, parallel over time: dq, dk, d/da) -> the op's layout.

Pass 2 is parallel over time, so every chunk needs the state before it as a tensor. The
fused forward keeps the states in VMEM only (not writing them to HBM is its point), so the
backward recomputes them with `chunk_fwd_h`: that is the only way to have them in a pass
that is parallel over time. Fixed-length inputs only (see `impl.supports`); re-layouts come from
`gla_core.chunk.prepare` and are differentiated by hand, as in `gla_core.chunk.pipeline`, with
the same transformation guards (first-order autodiff only, vmap folded into B, no kernel for
calls without tokens).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from gla_core.kit import (
    DEFAULT_BLOCK_SIZES,
    BlockSizes,
    ChunkConfig,
    KernelInputs,
    chunk_bwd_dqkg,
    chunk_fwd_h,
    define_chunk_vjp,
    empty_attention,
    floor_cumsum_gates,
    fold_vmap,
    has_no_tokens,
    heads_per_group,
    kernel_inputs,
    merge_heads,
    op_gradients,
    pad_axis,
    prepare,
    round_up,
    split_heads,
)
from gla_fused.fused_chunk.backward import fused_chunk_bwd_dhdv
from gla_fused.fused_chunk.forward import ForwardGeometry, fused_chunk_fwd
from gla_fused.fused_chunk.specs import FusedSpecs
from gla_fused.fused_chunk.steps import (
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_KERNEL_CHUNK,
    DEFAULT_NUM_STEPS,
    block_tokens_for,
    effective_num_steps,
)

IMPLEMENTATION = "fused_chunk"
OP = "simple_gla"


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """Static facts of one call (the non-differentiable argument of the custom VJP).

    Attributes:
      chunk: the chunk path's config (geometry, scale, dtypes, block sizes, interpret).
      num_steps: chunks per grid iteration of the backward's fused kernel, a divisor of NT.
      kernel_chunk: the forward kernel's chunk (its own, see `steps.DEFAULT_KERNEL_CHUNK`).
      block_tokens: tokens per grid step of the forward kernel, a multiple of `kernel_chunk`.
    """

    chunk: ChunkConfig
    num_steps: int
    kernel_chunk: int = DEFAULT_KERNEL_CHUNK
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    @classmethod
    def create(
        cls,
        q,
        v,
        *,
        num_steps: int = DEFAULT_NUM_STEPS,
        kernel_chunk: int = DEFAULT_KERNEL_CHUNK,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        **chunk_options,
    ) -> FusedConfig:
        """The config of a call; `chunk_options` as `ChunkConfig.create`. `num_steps` and
        `block_tokens` are upper bounds (see `steps`)."""
        chunk = ChunkConfig.create(q, v, **chunk_options)
        seq_len = chunk.geometry.seq_len
        return cls(
            chunk,
            effective_num_steps(chunk.geometry.num_chunks, num_steps),
            kernel_chunk,
            block_tokens_for(seq_len, kernel_chunk, block_tokens),
        )

    @property
    def padded_len(self) -> int:
        """T rounded up to the forward kernel's block."""
        return round_up(self.chunk.geometry.seq_len, self.block_tokens)

    def specs(self) -> FusedSpecs:
        """Forward-time specs of the fused kernels (V tiled like the chunk path, all of K)."""
        geo = self.chunk.geometry
        return FusedSpecs(
            chunk=geo.chunk,
            num_steps=self.num_steps,
            num_chunks=geo.num_chunks,
            key_dim=geo.padded_key_dim,
            value_dim=geo.padded_value_dim,
            block_v=self.chunk.block_sizes.value_tile(geo.padded_value_dim),
        )


def _token_major(x, config: FusedConfig, heads: int, dtype):
    """[B, T, H, D] to the forward kernel's [B, Tp*Hp, D] (a free view unless T or H is padded)."""
    return merge_heads(pad_axis(pad_axis(x.astype(dtype), 1, config.padded_len), 2, heads))


def _gate_rows(config: FusedConfig, g, g_gamma, heads: int):
    """The per-step log decay g + g_gamma as float32 rows [B, Hp, Tp], floored for the kernel's
    compensated cumsums (a free view of a [B, T, H] gate in XLA's usual layout for it)."""
    geo = config.chunk.geometry
    gate = jnp.zeros((geo.batch, geo.num_heads, geo.seq_len), jnp.float32)
    if g is not None:
        gate = gate + jnp.swapaxes(g.astype(jnp.float32), 1, 2)
    if g_gamma is not None:
        gate = gate + g_gamma.astype(jnp.float32)[:, None]
    return pad_axis(pad_axis(floor_cumsum_gates(gate), 2, config.padded_len), 1, heads)


def _fused_forward(config: FusedConfig, q, k, v, g, g_gamma, initial_state):
    """(o [B, T, H, V] in v's dtype, final state [B, H, K, V] float32 or None) from the forward kernel."""
    cfg = config.chunk
    geo = cfg.geometry
    dtype = cfg.compute_dtype
    heads = round_up(geo.num_heads, heads_per_group(dtype))
    h0 = None if initial_state is None else pad_axis(initial_state.astype(jnp.float32), 1, heads)
    kernel_geometry = ForwardGeometry(
        num_heads=heads,
        chunk=config.kernel_chunk,
        block_tokens=config.block_tokens,
        scale=cfg.scale,
        has_h0=h0 is not None,
        has_ht=cfg.output_final_state,
        mxu_dtype=jnp.dtype(dtype),
        interpret=cfg.interpret,
    )
    arrays = (*(_token_major(x, config, heads, dtype) for x in (q, k, v)), _gate_rows(config, g, g_gamma, heads), h0)
    launch = functools.partial(fused_chunk_fwd, geo=kernel_geometry)
    o, ht = fold_vmap(launch, arrays, in_axes=(0,) * 5, out_axes=0)
    o = split_heads(o, heads)[:, : geo.seq_len, : geo.num_heads].astype(v.dtype)
    return o, (ht[:, : geo.num_heads] if ht is not None else None)


def _forward(config: FusedConfig, q, k, v, g, g_gamma, initial_state):
    outputs = _fused_forward(config, q, k, v, g, g_gamma, initial_state)
    # The backward's kernels take the transposed chunk layout; in a forward-only program XLA drops it.
    return outputs, kernel_inputs(config.chunk, q, k, v, g, g_gamma, None, initial_state, None)


def _backward(config: FusedConfig, x: KernelInputs, cotangents):
    cfg = config.chunk
    geo, interpret, scale = cfg.geometry, cfg.interpret, cfg.scale
    do, dht = cotangents
    h, _ = chunk_fwd_h(x.k, x.v, x.gate, x.h0, x.meta, specs=cfg.specs(), output_final_state=False, interpret=interpret)
    dok = prepare.to_kernel(do, geo, None, cfg.compute_dtype)
    dhtk = prepare.state_in(dht, geo) if cfg.output_final_state and dht is not None else None
    dv, dh, dh0 = fused_chunk_bwd_dhdv(
        x.q,
        x.k,
        dok,
        x.gate,
        dhtk,
        specs=config.specs().reversed(),
        scale=scale,
        need_dh0=x.h0 is not None,
        interpret=interpret,
    )
    dq, dk, da = chunk_bwd_dqkg(
        x.q,
        x.k,
        x.v,
        dok,
        x.gate,
        h,
        dh,
        specs=cfg.dqkg_specs(),
        scale=scale,
        interpret=interpret,
        float32_products=x.float32_gate_grad,
    )
    dq, dk, dv, dg, dg_gamma, _, d_initial = op_gradients(cfg, None, dq, dk, dv, da, dh0, None)
    return dq, dk, dv, dg, dg_gamma, d_initial


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_attention(config, q, k, v, g, g_gamma, initial_state):
    return _forward(config, q, k, v, g, g_gamma, initial_state)[0]


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
    chunk_size: int = 64,
    num_steps: int = DEFAULT_NUM_STEPS,
    kernel_chunk: int = DEFAULT_KERNEL_CHUNK,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    interpret: bool = False,
    block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES,
):
    """simple_gla on the fused Pallas TPU kernels (fixed-length inputs).

    `S_t = e^{a_t} S_{t-1} + k_t v_t^T`, `o_t = scale * q_t^T S_t`, with the per-step log
    decay `a_t = g_t + g_gamma` (either or both may be absent). Arguments are already
    validated (see `gla_core.validation`).

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V] (bfloat16 or float32; other float dtypes are
        computed in float32).
      g: [B, T, H] or None; g_gamma: [H] or None.
      scale: multiplies q; None means K ** -0.5.
      initial_state: [B, H, K, V] or None.
      output_final_state: also return the final states [B, H, K, V] float32.
      chunk_size: 16, 32, 64 or 128.
      num_steps: chunks per grid iteration of the backward's fused kernel, at most (the largest
        divisor of the number of chunks that is <= num_steps is used).
      kernel_chunk: the forward kernel's chunk (a power of two, 16 to 128); `chunk_size` is the
        chunk of the backward's kernels. Both give the same function up to rounding.
      block_tokens: tokens per grid step of the forward kernel, at most.
      interpret: run the kernels in TPU interpret mode.
      block_sizes: kernel tile sizes (`block_v` tiles V in the fused kernels).

    Returns:
      (o [B, T, H, V] in v's dtype, final_state or None). Differentiable in q, k, v, g,
      g_gamma and initial_state.

    Example:
      >>> o, ht = fused_chunk_attention(q, k, v, g=g, output_final_state=True, interpret=True)
    """
    if has_no_tokens(q):
        return empty_attention(
            q, v, initial_state=initial_state, num_states=q.shape[0], output_final_state=output_final_state
        )
    config = FusedConfig.create(
        q,
        v,
        num_steps=num_steps,
        kernel_chunk=kernel_chunk,
        block_tokens=block_tokens,
        chunk_size=chunk_size,
        scale=scale,
        output_final_state=output_final_state,
        interpret=interpret,
        block_sizes=block_sizes,
        k=k,
        g=g,
        g_gamma=g_gamma,
        initial_state=initial_state,
    )
    o, final_state = _fused_attention(config, q, k, v, g, g_gamma, initial_state)
    return o, (final_state if output_final_state else None)
