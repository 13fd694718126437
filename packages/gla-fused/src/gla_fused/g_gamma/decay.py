"""Analytic in-chunk decays of a constant per-head log decay `gamma` (no cumsum, no gate tensor).

Every step of a head decays the state by `e^{gamma}`. In a chunk with `n` valid steps
(`n = min(C, T - c C)`; the steps after them are zero padding), step `t` sits at position
`p_t = min(t + 1, n)`: padding steps repeat the last position, so they decay nothing and
the state after the chunk is decayed by exactly `e^{gamma n}`. With `b_t = gamma p_t`:

  from_start  e^{b_t}                 [C, 1]  decay from the chunk start through step t
  to_end      e^{b_n - b_t}           [C, 1]  decay after step t to the chunk end
  last        e^{gamma n}             [1, 1]  decay over the whole chunk
  pairs       e^{gamma (p_t - p_s)}   [C, C]  for t >= s, else 0

Exponents are `gamma` times a non-negative integer (the lag is masked to 0 above the
diagonal before `exp`), so for `gamma <= 0` no argument is positive: with `gamma = -10`
and C = 128 nothing overflows, where `e^{b_t} e^{-b_s}` would. A hard reset (`gamma = -inf`)
arrives floored at `gla_core.kit.GATE_FLOOR` (the pipeline does it): `-inf * 0` would
be NaN for the lag-0 and position-0 factors, `GATE_FLOOR * 0 = 0` gives their exact `e^0 = 1`,
and every other factor underflows to exactly 0. The derivatives in `gamma`
(used by the backward) multiply each factor by its exponent over gamma: `p_t`, `n - p_t`,
`n` and the lag `p_t - p_s`.

Pure `jax.numpy` on 2-D arrays, so the same code runs inside Pallas TPU kernels and in
plain JAX tests.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32


def valid_steps(chunk_index, chunk: int, seq_len: int):
    """n: the number of non-padding steps of chunk `chunk_index` (int32 scalar, 1..C)."""
    return jnp.minimum(chunk, seq_len - chunk_index * chunk)


@dataclasses.dataclass(frozen=True)
class ChunkDecay:
    """The decays of one chunk of one head.

    Attributes:
      gamma: the head's log decay per step, a float32 scalar.
      valid: n, the number of valid steps of the chunk (int32 scalar or int).
      chunk: C, the chunk length (static).
    """

    gamma: jax.Array
    valid: jax.Array
    chunk: int

    @functools.cached_property
    def positions(self) -> jax.Array:
        """p_t = min(t + 1, n) as a column [C, 1] float32."""
        steps = jax.lax.broadcasted_iota(jnp.int32, (self.chunk, 1), 0)
        return jnp.minimum(steps + 1, self.valid).astype(F32)

    @functools.cached_property
    def remaining(self) -> jax.Array:
        """n - p_t as a column [C, 1] float32 (>= 0)."""
        steps = jax.lax.broadcasted_iota(jnp.int32, (self.chunk, 1), 0)
        return (self.valid - jnp.minimum(steps + 1, self.valid)).astype(F32)

    @functools.cached_property
    def length(self) -> jax.Array:
        """n as a [1, 1] float32."""
        return jnp.full((1, 1), self.valid, jnp.int32).astype(F32)

    @functools.cached_property
    def lags(self) -> jax.Array:
        """p_t - p_s for t >= s, else 0: [C, C] float32."""
        rows = jax.lax.broadcasted_iota(jnp.int32, (self.chunk, self.chunk), 0)
        cols = jax.lax.broadcasted_iota(jnp.int32, (self.chunk, self.chunk), 1)
        lag = jnp.minimum(rows + 1, self.valid) - jnp.minimum(cols + 1, self.valid)
        return jnp.where(rows >= cols, lag, 0).astype(F32)

    @functools.cached_property
    def from_start(self) -> jax.Array:
        """e^{gamma p_t}: [C, 1]."""
        return jnp.exp(self.gamma * self.positions)

    @functools.cached_property
    def to_end(self) -> jax.Array:
        """e^{gamma (n - p_t)}: [C, 1]."""
        return jnp.exp(self.gamma * self.remaining)

    @functools.cached_property
    def last(self) -> jax.Array:
        """e^{gamma n}: [1, 1]."""
        return jnp.exp(self.gamma * self.length)

    @functools.cached_property
    def causal(self) -> jax.Array:
        """t >= s: [C, C] bool."""
        rows = jax.lax.broadcasted_iota(jnp.int32, (self.chunk, self.chunk), 0)
        cols = jax.lax.broadcasted_iota(jnp.int32, (self.chunk, self.chunk), 1)
        return rows >= cols

    def decayed(self, x: jax.Array) -> jax.Array:
        """`x_ts e^{gamma (p_t - p_s)}` for t >= s, else 0, for x [C, C]: selected with `jnp.where`,
        so a non-finite x_ts above the diagonal (a NaN at a later step) stays out."""
        return jnp.where(self.causal, x, 0.0) * self.pairs

    @functools.cached_property
    def pairs(self) -> jax.Array:
        """e^{gamma (p_t - p_s)} for t >= s, else 0: [C, C]."""
        return jnp.where(self.causal, jnp.exp(self.gamma * self.lags), 0.0)

    @functools.cached_property
    def pairs_tangent(self) -> jax.Array:
        """d/dgamma of `pairs`: (p_t - p_s) e^{gamma (p_t - p_s)} for t >= s, else 0: [C, C]."""
        return self.lags * self.pairs
