"""The attention matrix of simple_gla, FLA's `parallel_simple_gla(..., output_attentions=True)`.

    A[b, h, i, j] = scale * q_i . k_j * exp(g_{j+1} + ... + g_i)   for j <= i,   0 for j > i

The decay sums are formed row by row as suffix sums from the diagonal outward (a cumulative sum of
the row's gates t <= i, read backwards), never as differences of long prefix sums: each sum only
accumulates its own terms, so its error stays relative to its value (a prefix-sum difference would
lose the low bits of a small decay next to a large cumulative one). Masked before `exp`; a `-inf`
gate is a hard reset (its decay is exactly 0). Plain `jnp` in float32 (float64 for float64 inputs),
differentiable; `[B, H, T, T]` memory, as the result.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gla_simple.numerics import compute_dtype, einsum, floor_log_decays


@functools.partial(jax.jit, static_argnames="scale")
def attention_matrix(q, k, g, scale: float):
    """A [B, H, T, T] in q's dtype for q, k [B, T, H, K] and per-step log decays g [B, T, H] (or None)."""
    dtype = compute_dtype(q.dtype)
    seq_len = q.shape[1]
    scores = scale * einsum("bihk,bjhk->bhij", q.astype(dtype), k.astype(dtype))
    rows = jnp.arange(seq_len)[:, None]
    cols = jnp.arange(seq_len)[None, :]
    causal = cols <= rows
    if g is not None:
        gates = floor_log_decays(jnp.moveaxis(g.astype(dtype), 1, 2))[..., None, :]  # [B, H, 1, T(t)]
        row_gates = jnp.where(causal, gates, 0.0)  # [B, H, T(i), T(t)]: g_t for t <= i
        suffix = jnp.cumsum(row_gates[..., ::-1], axis=-1)[..., ::-1]  # sum over t >= j of row i's gates
        gaps = jnp.concatenate([suffix[..., 1:], jnp.zeros_like(suffix[..., :1])], axis=-1)  # t > j
        scores = scores * jnp.exp(jnp.where(causal, gaps, 0.0))
    return jnp.where(causal, scores, 0.0).astype(q.dtype)
