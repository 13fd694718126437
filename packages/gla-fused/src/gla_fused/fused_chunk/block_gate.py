"""The scalar gates of all chunks of one grid iteration at once (the fused kernels' batched form).

`gla_core.kit.ScalarGate` is one chunk's gate; `BlockGate` holds the per-step log decays of the
S chunks an iteration handles, `a` `[S, C]`, and gives every chunk's quantities stacked on a
leading chunk axis, for matmuls batched over it (`gla_core.kit.BATCHED_NN/NT/TN`). Exponents are
segment sums of log decays (<= 0), never differences of cumulative sums, as in `ScalarGate`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gla_core.kit import BATCHED_NT, NN, ChunkMasks, dot

F32 = jnp.float32


def rows_to_columns(rows: jax.Array, diagonal: jax.Array) -> jax.Array:
    """[S, C] -> [S, C, 1] exactly (diagonal select and lane sum; no transpose op)."""
    return jnp.sum(jnp.where(diagonal[None], rows[:, None, :], 0.0), axis=2, keepdims=True)


class BlockGate:
    """Per-step log decays `a` [S, C] (float32) of S chunks of C steps; `masks` of one chunk."""

    def __init__(self, a: jax.Array, masks: ChunkMasks):
        self.a = a
        self.masks = masks

    @functools.cached_property
    def decay(self) -> jax.Array:
        """e^{b_t - b_s} for t >= s, else 0: [S, C, C]."""
        n, c = self.a.shape
        causal = self.masks.causal[None]
        rows = jnp.where(causal, self.a[:, None, :], 0.0).reshape(n * c, c)
        segment = dot(rows, self.masks.strict_lower, NN, F32).reshape(n, c, c)  # sum_{s<u<=t} a_u
        return jnp.where(causal, jnp.exp(jnp.where(causal, segment, 0.0)), 0.0)

    @functools.cached_property
    def from_start(self) -> jax.Array:
        """e^{b_t}, b_t = sum_{u<=t} a_u: [S, C, 1]."""
        return rows_to_columns(jnp.exp(dot(self.a, self.masks.upper, NN, F32)), self.masks.diagonal)

    @functools.cached_property
    def to_end(self) -> jax.Array:
        """e^{b_L - b_t} = e^{sum_{u>t} a_u}: [S, C, 1]."""
        return rows_to_columns(jnp.exp(dot(self.a, self.masks.strict_lower, NN, F32)), self.masks.diagonal)

    @functools.cached_property
    def last(self) -> jax.Array:
        """e^{b_L}, the decay over each whole chunk: [S, 1]."""
        return jnp.exp(jnp.sum(self.a, axis=1, keepdims=True))

    def scores(self, x: jax.Array, y: jax.Array, dtype) -> jax.Array:
        """(x_t . y_s) e^{b_t - b_s} for t >= s, else 0 (selected, so a NaN above the diagonal stays
        out), for x, y [S, C, K]: [S, C, C] float32."""
        return jnp.where(self.masks.causal[None], dot(x, y, BATCHED_NT, dtype), 0.0) * self.decay
