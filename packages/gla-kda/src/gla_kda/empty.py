"""The result of a kda call without tokens (B = 0 or T = 0), shared by every implementation.

Nothing is computed: the output is empty, and every sequence keeps its initial state (zeros
without one). Gradients follow by autodiff: zero-size for the token inputs, zero for A_log and
dt_bias, and the final-state cotangent for the initial state.
"""

from __future__ import annotations

import jax.numpy as jnp


def has_no_tokens(v) -> bool:
    """v [B, T, HV, V] holds no token (B = 0 or T = 0)."""
    return v.shape[0] == 0 or v.shape[1] == 0


def empty_result(v, key_dim: int, initial_state, output_final_state: bool, cu_seqlens, state_dtype):
    """(o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] in `state_dtype` or None) of a call without tokens.

    N is B, or the number of sequences of `cu_seqlens` [N+1] (all of them empty).
    """
    o = jnp.zeros(v.shape, v.dtype)
    if not output_final_state:
        return o, None
    if initial_state is None:
        num_states = v.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        return o, jnp.zeros((num_states, v.shape[2], key_dim, v.shape[3]), state_dtype)
    return o, initial_state.astype(state_dtype)


def result_without_tokens(args, state_dtype):
    """`empty_result` of a kda arguments record that holds no token, else None."""
    if not has_no_tokens(args.v):
        return None
    key_dim = args.q.shape[-1]
    return empty_result(args.v, key_dim, args.initial_state, args.output_final_state, args.cu_seqlens, state_dtype)
