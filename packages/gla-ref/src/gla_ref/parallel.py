"""The parallel (attention-matrix) form of simple_gla: FLA's `parallel_simple_gla` with `output_attentions`.

  A[b, h, i, j] = scale * q_i . k_j * exp(g_{j+1} + ... + g_i)   for j <= i,   0 for j > i
  o_i           = sum_j A[b, h, i, j] v_j

(no initial state). Meant for float64 under `jax.enable_x64(True)`. Each decay sum adds exactly the
gates between j and i (a [T, T, T] masked sum: test lengths only), so a -inf gate (a hard reset)
gives a decay of exactly 0 across it.
"""

from __future__ import annotations

import jax.numpy as jnp

from gla_ref import gates


def simple_gla_attention(q, k, g=None, scale=None):
    """The attention matrix `[B, H, T, T]` of simple_gla in the computation dtype.

    Args:
      q, k: `[B, T, H, K]`; g: per-step log decays `[B, T, H]` or None (no decay).
      scale: default `K ** -0.5`.
    """
    dtype = gates.compute_dtype(q, k, g)
    seq_len, key_dim = q.shape[1], q.shape[3]
    scale = key_dim**-0.5 if scale is None else scale
    scores = scale * jnp.einsum("bihk,bjhk->bhij", q.astype(dtype), k.astype(dtype))
    causal = jnp.tril(jnp.ones((seq_len, seq_len), bool))
    if g is not None:
        steps = jnp.arange(seq_len)
        between = (steps[None, :, None] < steps[None, None, :]) & (steps[None, None, :] <= steps[:, None, None])
        per_step = jnp.moveaxis(g.astype(dtype), 1, 2)[..., None, None, :]  # [B, H, 1, 1, T(t)]
        gaps = jnp.sum(jnp.where(between, per_step, 0.0), axis=-1)  # [B, H, T(i), T(j)]: the gates j < t <= i
        scores = scores * jnp.exp(jnp.where(causal, gaps, 0.0))
    return jnp.where(causal, scores, 0.0)
