"""The decode step in plain XLA: the fallback of the Pallas kernel (`decode_xla`), every backend.

On the token grid (`layout.TokenGrid`), per sequence and value head, state S [K, V] float32:

    S <- exp(g_t) S                          (g_t a scalar, or one per key: diag(exp(g_t)) S)
    S <- S + k_t w_t^T,  w_t = v_t           (plain gated linear attention)
                         w_t = beta_t (v_t - S^T k_t)   (the delta rule, kda)
    o_t = q_t^T S                            (q already scaled)

a `lax.scan` over the S_pad token positions (cells past a sequence's length change nothing). The
states are gathered from the pool, and scattered back (`mode="drop"` for the slots not written).
Differentiable by autodiff.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gla_core.decode.layout import PoolSlots, TokenGrid
from gla_core.decode.tokens import DecodeTokens


def _step(state, token, delta_rule: bool):
    """One token for every (sequence, head): state [N, HV, K, V]; q, k, g [N, HV, K or 1], v [N, HV, V]."""
    q, k, v, g, beta, valid = token
    decayed = jnp.exp(g)[..., None] * state
    w = v
    if delta_rule:
        w = beta * (v - jnp.einsum("nhk,nhkv->nhv", k, decayed, precision=jax.lax.Precision.HIGHEST))
    new = decayed + k[..., None] * w[..., None, :]
    o = jnp.einsum("nhk,nhkv->nhv", q, new, precision=jax.lax.Precision.HIGHEST)
    new = jnp.where(valid[:, None, None, None], new, state)
    return new, (o, new)


def decode_xla(tokens: DecodeTokens, pool, slots: PoolSlots, grid: TokenGrid, *, v_first: bool, token_states: bool):
    """The decode step.

    Args:
      tokens: the prepared tokens on the grid (`[N, S_pad, HV, X]`, float32 or float64).
      pool: [P, HV, K, V] (or [P, HV, V, K] when `v_first`) states, any float dtype.
      slots: read and write slots; grid: the token grid.
      v_first: the pool's layout.
      token_states: return the state after every grid cell `[N, S_pad, HV, K, V]` (pool layout,
        pool dtype) instead of the updated pool.

    Returns:
      (o [N, S_pad, HV, V] in the tokens' dtype, the updated pool, or the per-cell states).
    """
    swap = (lambda x: jnp.swapaxes(x, -1, -2)) if v_first else (lambda x: x)
    dtype = tokens.q.dtype  # float32, or float64 for float64 inputs
    start = jnp.where(slots.read_ok[:, None, None, None] == 1, pool[slots.read].astype(dtype), 0.0)
    time_major = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)
    valid = jnp.moveaxis(grid.valid(), 1, 0)  # [S_pad, N]
    beta = None if tokens.beta is None else time_major(tokens.beta)
    xs = (time_major(tokens.q), time_major(tokens.k), time_major(tokens.v), time_major(tokens.g), beta, valid)
    step = lambda state, token: _step(state, token, tokens.beta is not None)
    final, (o, states) = jax.lax.scan(step, swap(start), xs)
    o = jnp.moveaxis(o, 0, 1)  # [N, S_pad, HV, V]
    states = swap(jnp.moveaxis(states, 0, 1)).astype(pool.dtype)  # [N, S_pad, HV, ., .]
    if token_states:
        return o, states
    num_slots = pool.shape[0]
    if slots.per_token:
        slot = jnp.where(slots.write >= 0, slots.write, num_slots).reshape(-1)  # [N * S_pad]
        values = states.reshape(-1, *states.shape[2:])  # [N * S_pad, HV, ., .]
        return o, pool.at[slot].set(values, mode="drop")
    slot = jnp.where(slots.write[:, 0] >= 0, slots.write[:, 0], num_slots)
    return o, pool.at[slot].set(swap(final).astype(pool.dtype), mode="drop")
