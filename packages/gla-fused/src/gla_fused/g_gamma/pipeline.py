"""The differentiable op: simple_gla with only `g_gamma` on the two fused kernels.

Forward:  re-layout (`gla_core.chunk.prepare`) -> `fused_g_gamma_forward` -> back to [B, T, H, V].
Backward: re-layout do, dht -> `fused_g_gamma_backward` -> sum the per-V-tile partial sums of
          dq, dk and d gamma (over B too for d gamma) -> back to the op's layout.

One `jax.custom_vjp` covers the whole op (re-layouts are padding and transposes, whose
gradients are slicing and the inverse transposes); its residuals are the kernel-layout
inputs, nothing per chunk. g_gamma is floored at `gla_core.chunk.gates.GATE_FLOOR` (a hard
reset of -inf stays exact; its gradient is 0). Transformations as in `gla_core.chunk.pipeline`:
first-order autodiff only, vmap folded into B, no kernel for calls without tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from gla_core.kit import (
    DEFAULT_BLOCK_SIZES,
    GATE_FLOOR,
    BlockSizes,
    ChunkConfig,
    empty_attention,
    first_order_only,
    floor_gates,
    has_no_tokens,
    prepare,
)
from gla_fused.g_gamma.backward import fused_g_gamma_backward
from gla_fused.g_gamma.forward import fused_g_gamma_forward
from gla_fused.g_gamma.specs import GammaSpecs

IMPLEMENTATION = "fused_g_gamma"
OP = "simple_gla"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Residuals:
    """Kernel-layout inputs kept for the backward: q, k [B, H, Tp, Kp], v [B, H, Tp, Vp] (compute
    dtype), gamma [H] float32, h0 [B, H, Vp, Kp] float32 or None."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    gamma: jax.Array
    h0: jax.Array | None


def _specs(config: ChunkConfig, backward: bool) -> GammaSpecs:
    geo = config.geometry
    block_v = config.block_sizes.value_tile(geo.padded_value_dim)
    return GammaSpecs(geo.chunk, geo.num_chunks, geo.padded_key_dim, block_v, backward=backward)


def _forward(config: ChunkConfig, q, k, v, g_gamma, initial_state):
    geo = config.geometry
    x = Residuals(
        *(prepare.to_kernel(a, geo, None, config.compute_dtype) for a in (q, k, v)),
        gamma=floor_gates(g_gamma.astype(jnp.float32)),
        h0=prepare.state_in(initial_state, geo) if initial_state is not None else None,
    )
    o, ht = fused_g_gamma_forward(
        x.q,
        x.k,
        x.v,
        x.gamma,
        x.h0,
        specs=_specs(config, backward=False),
        seq_len=geo.seq_len,
        scale=config.scale,
        output_final_state=config.output_final_state,
        interpret=config.interpret,
    )
    o = prepare.from_kernel(o, geo, None, geo.value_dim, v.dtype)
    ht = prepare.state_out(ht, geo) if ht is not None else None
    return (o, ht), x


def _sum_tiles(partial, geo, width: int, dtype):
    """[B, H, NV, Tp, D] partial sums per V tile to [B, T, H, width] in `dtype`."""
    total = partial[:, :, 0] if partial.shape[2] == 1 else jnp.sum(partial, axis=2)
    return prepare.from_kernel(total, geo, None, width, dtype)


def _backward(config: ChunkConfig, x: Residuals, cotangents):
    do, dht = cotangents
    geo = config.geometry
    dok = prepare.to_kernel(do, geo, None, config.compute_dtype)
    dhtk = prepare.state_in(dht, geo) if config.output_final_state and dht is not None else None
    dq, dk, dv, dgamma, dh0 = fused_g_gamma_backward(
        x.q,
        x.k,
        x.v,
        dok,
        x.gamma,
        x.h0,
        dhtk,
        specs=_specs(config, backward=True),
        seq_len=geo.seq_len,
        scale=config.scale,
        interpret=config.interpret,
    )
    dq = _sum_tiles(dq, geo, geo.key_dim, config.dtype_of("q"))
    dk = _sum_tiles(dk, geo, geo.key_dim, config.dtype_of("k"))
    dv = prepare.from_kernel(dv, geo, None, geo.value_dim, config.dtype_of("v"))
    dg_gamma = jnp.sum(dgamma[..., 0, 0], axis=(0, 2))  # [H]
    dg_gamma = jnp.where(x.gamma <= GATE_FLOOR, 0.0, dg_gamma).astype(config.dtype_of("g_gamma"))
    d_initial = None
    if dh0 is not None:
        d_initial = prepare.state_out(dh0, geo, config.dtype_of("initial_state"))
    return dq, dk, dv, dg_gamma, d_initial


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_g_gamma(config, q, k, v, g_gamma, initial_state):
    return _forward(config, q, k, v, g_gamma, initial_state)[0]


_fused_g_gamma.defvjp(
    first_order_only(_forward, implementation=IMPLEMENTATION, op=OP, nondiff_argnums=(0,)),
    first_order_only(_backward, implementation=IMPLEMENTATION, op=OP, nondiff_argnums=(0,)),
)


def fused_g_gamma_attention(
    q,
    k,
    v,
    g_gamma,
    *,
    scale: float | None = None,
    initial_state=None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    interpret: bool = False,
    block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES,
):
    """simple_gla with a constant per-head decay on the fused Pallas TPU kernels.

    `S_t = e^{g_gamma} S_{t-1} + k_t v_t^T`, `o_t = scale * q_t^T S_t`. Arguments are already
    validated (see `gla_core.validation`).

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V] (bfloat16 or float32; other float dtypes compute in
        float32).
      g_gamma: [H] log decay per step (<= 0 keeps every exponent <= 0).
      scale: multiplies q; None means K ** -0.5.
      initial_state: [B, H, K, V] or None.
      output_final_state: also return the final states [B, H, K, V] float32.
      chunk_size: 16, 32, 64 or 128.
      interpret: run the kernels in TPU interpret mode.
      block_sizes: `block_v` sets the V tile (K is never tiled).

    Returns:
      (o [B, T, H, V] in v's dtype, final_state or None); differentiable in q, k, v,
      g_gamma and initial_state.
    """
    if has_no_tokens(q):
        return empty_attention(
            q, v, initial_state=initial_state, num_states=q.shape[0], output_final_state=output_final_state
        )
    config = ChunkConfig.create(
        q,
        v,
        chunk_size=chunk_size,
        scale=scale,
        output_final_state=output_final_state,
        interpret=interpret,
        block_sizes=block_sizes,
        k=k,
        g_gamma=g_gamma,
        initial_state=initial_state,
    )
    o, final_state = _fused_g_gamma(config, q, k, v, g_gamma, initial_state)
    return o, (final_state if output_final_state else None)
