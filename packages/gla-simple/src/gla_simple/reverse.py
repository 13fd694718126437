"""FLA's `reverse=True` of `fused_recurrent_*`: the state passes from the last token to the first.

    S_t = exp(g_t) S_{t+1} + k_t v_t^T,   o_t = scale * q_t^T S_t    (t from the end; S_T = initial_state)

is the forward recurrence on the tokens of every sequence in reverse order, with `o` put back in
order. `reversed_tokens` gives that permutation of the token axis (an involution), for fixed-length
rows or packed sequences (`cu_seqlens`, may be traced); gathers are differentiable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reversed_tokens(seq_len: int, cu_seqlens=None) -> jax.Array:
    """[T] int32: the token that comes at position i when every sequence is read backwards."""
    tokens = jnp.arange(seq_len, dtype=jnp.int32)
    if cu_seqlens is None:
        return tokens[::-1]
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    sequence = jnp.clip(jnp.searchsorted(cu[1:], tokens, side="right"), 0, cu.shape[0] - 2)
    return cu[sequence] + cu[sequence + 1] - 1 - tokens


def reverse_time(x, order: jax.Array):
    """x [B, T, ...] (or None) with its token axis permuted by `order`."""
    return None if x is None else jnp.take(x, order, axis=1)
