"""The serving decode path with a state pool, defined on the token-by-token recurrence.

The definition (`gla_core.state_args` gives the arguments): every sequence n runs the recurrence
of its op from `initial_state = pool[read slot of n]` (zeros for a padding slot), exactly as a
call with `initial_state` would; then

  1-D `ssm_state_indices [N]`:     pool[idx[n]] = the state after the sequence's last token
  2-D `ssm_state_indices [N, S]`:  pool[idx[n, t]] = the state after its token t   (t < length)

with padding slots (< 0 or >= P) neither read nor written, and sequences without tokens reading
and writing nothing. The read slot is idx[n] (1-D) or idx[n, num_accepted_tokens[n] - 1] (2-D;
num_accepted_tokens defaults to ones). A token at position t >= S of a sequence in 2-D mode has no
slot: its output is NaN (such calls are invalid; this makes them visible). With
`inplace_final_state=True` the result is `(o, updated pool)`; with False `(o, states after every
token [B, T, HV, K, V])` (the pool unchanged). Both in the pool's dtype; `o` in the computation
dtype. Computed in the promoted input dtype (float64 under `jax.enable_x64` for float64 inputs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gla_ref import recurrent

RECURRENCES = {"simple_gla": recurrent.simple_gla, "gla": recurrent.gla, "kda": recurrent.kda}


def _sequence_of_tokens(batch: int, seq_len: int, cu_seqlens):
    """(sequence id, position in the sequence) of every token `[B, T]` (int32)."""
    if cu_seqlens is None:
        positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
        sequence = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], (batch, seq_len))
        return sequence, positions
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    tokens = jnp.arange(seq_len, dtype=jnp.int32)
    sequence = jnp.clip(jnp.searchsorted(cu[1:], tokens, side="right"), 0, cu.shape[0] - 2).astype(jnp.int32)
    return sequence[None], (tokens - cu[sequence])[None]


def decode(
    op: str,
    q,
    k,
    v,
    *,
    initial_state,
    ssm_state_indices,
    num_accepted_tokens=None,
    inplace_final_state: bool = True,
    cu_seqlens=None,
    state_v_first: bool = False,
    **op_arguments,
):
    """The decode path of `op` ("simple_gla", "gla" or "kda") with a state pool.

    Args:
      op: the op.
      q, k: `[B, T, H, K]`; v: `[B, T, HV, V]` (B == 1 with `cu_seqlens`).
      initial_state: the pool `[P, HV, K, V]` (`[P, HV, V, K]` with `state_v_first`).
      ssm_state_indices: int `[N]` or `[N, S]` slots (see the module doc).
      num_accepted_tokens: int `[N]` (2-D indices only), or None.
      inplace_final_state: return the updated pool (True) or the per-token states (False).
      cu_seqlens: `[N+1]` packed boundaries, or None (N = B).
      state_v_first: the pool's layout.
      **op_arguments: the op's other arguments (gates, scale, kda options).

    Returns:
      `(o [B, T, HV, V], pool [P, HV, K, V] or states [B, T, HV, K, V])` (see the module doc).
    """
    pool = initial_state
    batch, seq_len = q.shape[:2]
    num_slots = pool.shape[0]
    idx = jnp.asarray(ssm_state_indices).astype(jnp.int32)
    num_sequences = idx.shape[0]
    rows = jnp.arange(num_sequences)
    if idx.ndim == 1:
        read = idx
    else:
        accepted = jnp.ones((num_sequences,), jnp.int32) if num_accepted_tokens is None else num_accepted_tokens
        read = idx[rows, jnp.asarray(accepted).astype(jnp.int32) - 1]
    readable = (read >= 0) & (read < num_slots)
    h0 = jnp.where(readable[:, None, None, None], pool[jnp.clip(read, 0, num_slots - 1)], 0)
    o, final, states = RECURRENCES[op](
        q,
        k,
        v,
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu_seqlens,
        state_v_first=state_v_first,
        token_states=True,
        **op_arguments,
    )
    sequence, position = _sequence_of_tokens(batch, seq_len, cu_seqlens)
    if idx.ndim == 2:  # tokens past the S slots of their sequence have no state to go to
        o = jnp.where((position < idx.shape[1])[..., None, None], o, jnp.nan)
    if not inplace_final_state:
        return o, states.astype(pool.dtype)
    if idx.ndim == 1:
        if cu_seqlens is None:
            written = jnp.full((num_sequences,), seq_len > 0)
        else:
            cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
            written = cu[1:] > cu[:-1]
        slots = jnp.where(written & (idx >= 0), idx, num_slots)  # num_slots: dropped
        return o, pool.at[slots].set(final.astype(pool.dtype), mode="drop")
    slot = idx[sequence, jnp.clip(position, 0, idx.shape[1] - 1)]  # [B, T]
    slot = jnp.where((position < idx.shape[1]) & (slot >= 0), slot, num_slots)
    return o, pool.at[slot.reshape(-1)].set(states.reshape(-1, *states.shape[2:]).astype(pool.dtype), mode="drop")


def float64_oracle(op: str, arrays: dict, **options):
    """`decode` in float64 on the given arrays (cast up from their dtypes), as numpy arrays.

    Args:
      op: "simple_gla", "gla" or "kda".
      arrays: q, k, v, the gates (and kda's beta, A_log, dt_bias), initial_state (the pool),
        ssm_state_indices, num_accepted_tokens, cu_seqlens: jax or numpy arrays by name.
      **options: everything else (scale, inplace_final_state, state_v_first, kda's flags).

    Returns:
      (o, pool or per-token states) as float64 numpy arrays.
    """
    integers = ("ssm_state_indices", "num_accepted_tokens", "cu_seqlens")
    with jax.enable_x64(True):
        cast = {
            name: jnp.asarray(np.asarray(x)) if name in integers else jnp.asarray(np.asarray(x, np.float64))
            for name, x in arrays.items()
            if x is not None
        }
        q, k, v = (cast.pop(name) for name in ("q", "k", "v"))
        o, states = jax.jit(functools.partial(decode, op, **options))(q, k, v, **cast)
        return np.asarray(o, np.float64), np.asarray(states, np.float64)
