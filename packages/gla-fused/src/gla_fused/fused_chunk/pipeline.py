"""simple_gla on the fused kernels, with its split backward (one `jax.custom_vjp`).

Forward:  prepare -> fused_chunk_fwd (states in VMEM, o written directly) -> [B, T, H, V].
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

from gla_core.kit import (
    DEFAULT_BLOCK_SIZES,
    BlockSizes,
    ChunkConfig,
    KernelInputs,
    chunk_bwd_dqkg,
    chunk_fwd_h,
    define_chunk_vjp,
    empty_attention,
    has_no_tokens,
    kernel_inputs,
    op_gradients,
    prepare,
)
from gla_fused.fused_chunk.backward import fused_chunk_bwd_dhdv
from gla_fused.fused_chunk.forward import fused_chunk_fwd
from gla_fused.fused_chunk.specs import FusedSpecs
from gla_fused.fused_chunk.steps import DEFAULT_NUM_STEPS, effective_num_steps

IMPLEMENTATION = "fused_chunk"
OP = "simple_gla"


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """Static facts of one call (the non-differentiable argument of the custom VJP).

    Attributes:
      chunk: the chunk path's config (geometry, scale, dtypes, block sizes, interpret).
      num_steps: chunks per grid iteration of the fused kernels, a divisor of NT.
    """

    chunk: ChunkConfig
    num_steps: int

    @classmethod
    def create(cls, q, v, *, num_steps: int = DEFAULT_NUM_STEPS, **chunk_options) -> FusedConfig:
        """The config of a call; `chunk_options` as `ChunkConfig.create`. `num_steps` is an upper
        bound: the largest divisor of the number of chunks that is <= it is used."""
        chunk = ChunkConfig.create(q, v, **chunk_options)
        return cls(chunk, effective_num_steps(chunk.geometry.num_chunks, num_steps))

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


def _forward(config: FusedConfig, q, k, v, g, g_gamma, initial_state):
    cfg = config.chunk
    geo = cfg.geometry
    x = kernel_inputs(cfg, q, k, v, g, g_gamma, None, initial_state, None)
    o, ht = fused_chunk_fwd(
        x.q,
        x.k,
        x.v,
        x.gate,
        x.h0,
        specs=config.specs(),
        scale=cfg.scale,
        output_final_state=cfg.output_final_state,
        interpret=cfg.interpret,
    )
    o = prepare.from_kernel(o, geo, None, geo.value_dim, v.dtype)
    ht = prepare.state_out(ht, geo) if ht is not None else None
    return (o, ht), x


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
      num_steps: chunks per grid iteration, at most (the largest divisor of the number of
        chunks that is <= num_steps is used).
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
