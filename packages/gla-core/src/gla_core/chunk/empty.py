"""Calls without tokens (B = 0 or T = 0): their result, without launching a kernel.

A Pallas grid with a zero-size axis reads out of bounds, so the Pallas implementations answer
such calls here: `o` is empty, every final state is its initial state (zeros without one), and
the gradients follow from that (zeros, and the final-state cotangent for the initial state).
"""

from __future__ import annotations

import jax.numpy as jnp


def has_no_tokens(q) -> bool:
    """q [B, T, H, K] holds no token (B = 0 or T = 0; varlen: only empty sequences)."""
    return q.shape[0] == 0 or q.shape[1] == 0


def empty_attention(q, v, *, initial_state, num_states: int, output_final_state: bool):
    """The result of a call without tokens.

    Args:
      q: [B, T, H, K]; v: [B, T, H, V] with B * T == 0.
      initial_state: [N, H, K, V] or None; num_states: N.
      output_final_state: also return the final states.

    Returns:
      (o [B, T, H, V] in v's dtype (empty), final_state [N, H, K, V] float32 or None).
    """
    if not has_no_tokens(q):
        raise ValueError(f"empty_attention: q of shape {q.shape} has tokens")
    o = jnp.zeros(v.shape, v.dtype)
    if not output_final_state:
        return o, None
    if initial_state is None:
        return o, jnp.zeros((num_states, q.shape[2], q.shape[3], v.shape[3]), jnp.float32)
    return o, initial_state.astype(jnp.float32)
