"""Token-by-token recurrences: the obviously right definition of every op.

Per value head, with a state `S [K, V]`:

  simple_gla / gla:  S_t = exp(g_t) * S_{t-1} + k_t v_t^T          (g_t scalar or per key)
  kda:               S'  = diag(exp(g_t)) S_{t-1}
                     S_t = S' + beta_t k_t (v_t - S'^T k_t)^T
  every op:          o_t = scale * q_t^T S_t

Each function computes in the promoted dtype of its inputs (at least float32): called with
float64 inputs under `jax.enable_x64(True)` it is the float64 oracle. It is pure JAX
(`lax.scan`), differentiable, and works under `jit` with a traced `cu_seqlens`.

Varlen (`cu_seqlens [N+1]`, B == 1): the state is reset to `initial_state[n]` (zeros when
absent) at the start of sequence n; the final state of a zero-length sequence is its initial
state. Without `cu_seqlens`, each batch row is one sequence.

`chunk_size` is accepted and ignored, so these functions share the calling convention of
`gla_ref.chunked` and of the dispatch (`fn(**case.kwargs())`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gla_core.errors import InvalidArgumentError, ShapeError
from gla_ref import gates

kda_gate = gates.kda_gate


def _update(state, q_t, k_t, v_t, a_t, b_t, scale):
    """One token: decay, write (plain or delta rule), read.

    Args:
      state: `[..., HV, K, V]`; q_t, k_t: `[..., HV, K]`; v_t: `[..., HV, V]`;
      a_t: log decay `[..., HV, K]` or `[..., HV, 1]`; b_t: beta `[..., HV]`, or None for
      plain gated linear attention.

    Returns:
      `(new state, o_t [..., HV, V])`.
    """
    state = jnp.exp(a_t)[..., None] * state
    if b_t is None:
        state = state + k_t[..., None] * v_t[..., None, :]
    else:
        error = v_t - jnp.sum(state * k_t[..., None], axis=-2)  # [..., HV, V]
        state = state + b_t[..., None, None] * k_t[..., None] * error[..., None, :]
    return state, scale * jnp.sum(q_t[..., None] * state, axis=-2)


def _batch_scan(q, k, v, log_decay, beta, h0, scale, token_states: bool):
    """Each batch row is one sequence. Inputs `[B, T, ...]`, h0 `[B, HV, K, V]`; returns `(o, final,
    states)`, states `[B, T, HV, K, V]` after every token (None unless `token_states`)."""
    time_major = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)

    def step(state, token):
        state, o_t = _update(state, *token, scale)
        return state, (o_t, state if token_states else None)

    final, (o, states) = jax.lax.scan(step, h0, tuple(time_major(x) for x in (q, k, v, log_decay, beta)))
    return jnp.moveaxis(o, 0, 1), final, time_major(states)


def _packed_scan(q, k, v, log_decay, beta, h0, cu_seqlens, scale, token_states: bool):
    """Packed sequences `[T, ...]` (batch row 0), state reset to `h0[n] [N, HV, K, V]` at each start.

    `cu_seqlens` may be traced. Returns `(o [T, HV, V], final [N, HV, K, V], states [T, HV, K, V]
    after every token or None)`; a zero-length sequence's final state is its `h0[n]`.
    """
    seq_len = q.shape[0]
    steps = jnp.arange(seq_len, dtype=jnp.int32)
    sequence = jnp.clip(jnp.searchsorted(cu_seqlens[1:], steps, side="right"), 0, h0.shape[0] - 1)
    is_first = cu_seqlens[sequence] == steps
    is_last = cu_seqlens[sequence + 1] - 1 == steps

    def step(carry, token):
        state, finals = carry
        n, first, last, *inputs = token
        state, o_t = _update(jnp.where(first, h0[n], state), *inputs, scale)
        finals = finals.at[n].set(jnp.where(last, state, finals[n]))
        return (state, finals), (o_t, state if token_states else None)

    init = (jnp.zeros(h0.shape[1:], h0.dtype), h0)
    (_, finals), (o, states) = jax.lax.scan(step, init, (sequence, is_first, is_last, q, k, v, log_decay, beta))
    return o, finals, states


def _to_k_first(state, state_v_first: bool):
    """[..., V, K] -> [..., K, V] when `state_v_first` (its own inverse)."""
    return jnp.swapaxes(state, -1, -2) if state_v_first and state is not None else state


def _recurrence(
    q, k, v, log_decay, beta, *, scale, initial_state, output_final_state, cu_seqlens, state_v_first=False,
    token_states=False,
):  # fmt: skip
    """Runs the recurrence per batch row, or over the packed varlen stream.

    q, k: `[B, T, HV, K]` (heads already expanded); v: `[B, T, HV, V]`; log_decay:
    `[B, T, HV, K or 1]`; beta: `[B, T, HV]` or None; all in one dtype. With `state_v_first` the
    states (initial, final, per token) are `[..., V, K]`. Returns `(o, final or None)`, and the state
    after every token `[B, T, HV, K, V]` as a third result when `token_states`.
    """
    if cu_seqlens is not None:
        cu_seqlens = jnp.asarray(cu_seqlens).astype(jnp.int32)
    o, final, states = _recurrence_jit(
        q,
        k,
        v,
        log_decay,
        beta,
        scale=None if scale is None else float(scale),
        initial_state=_to_k_first(initial_state, state_v_first),
        cu_seqlens=cu_seqlens,
        token_states=token_states,
    )
    final = _to_k_first(final, state_v_first) if output_final_state else None
    if token_states:
        return o, final, _to_k_first(states, state_v_first)
    return o, final


@functools.partial(jax.jit, static_argnames=("scale", "token_states"))
def _recurrence_jit(q, k, v, log_decay, beta, *, scale, initial_state, cu_seqlens, token_states):
    batch, _, num_value_heads, key_dim = q.shape
    value_dim = v.shape[-1]
    scale = key_dim**-0.5 if scale is None else scale
    if cu_seqlens is None:
        num_sequences = batch
    else:
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise ShapeError(f"cu_seqlens: expected a 1-D array [N+1] with N >= 1, got shape {cu_seqlens.shape}")
        if batch != 1:
            raise ShapeError(f"cu_seqlens: packed sequences need batch size B == 1, got B = {batch}")
        num_sequences = cu_seqlens.shape[0] - 1
    state_shape = (num_sequences, num_value_heads, key_dim, value_dim)
    if initial_state is None:
        h0 = jnp.zeros(state_shape, q.dtype)
    else:
        if tuple(initial_state.shape) != state_shape:
            raise ShapeError(f"initial_state: expected shape [N, HV, K, V] = {state_shape}, got {initial_state.shape}")
        h0 = initial_state.astype(q.dtype)
    if cu_seqlens is None:
        return _batch_scan(q, k, v, log_decay, beta, h0, scale, token_states)
    first_row = lambda x: None if x is None else x[0]
    o, final, states = _packed_scan(
        *(first_row(x) for x in (q, k, v, log_decay, beta)), h0, cu_seqlens, scale, token_states
    )
    return o[None], final, None if states is None else states[None]


def simple_gla(
    q,
    k,
    v,
    g=None,
    g_gamma=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    chunk_size=None,
    state_v_first=False,
    token_states=False,
):
    """Gated linear attention with one scalar log decay per head and step.

    Args:
      q, k: `[B, T, H, K]`; v: `[B, T, H, V]`.
      g: optional per-step log decay `[B, T, H]`.
      g_gamma: optional constant log decay per head `[H]`; with g the decay is `g + g_gamma`.
        Neither: no decay (plain linear attention).
      scale: float, default `K ** -0.5`.
      initial_state: optional `[N, H, K, V]`.
      output_final_state: return the final states.
      cu_seqlens: optional int32 `[N+1]` boundaries of packed sequences (B == 1).
      chunk_size: ignored.
      state_v_first: the states (initial, final, per token) are `[..., V, K]` instead of `[..., K, V]`.
      token_states: also return the state after every token, `[B, T, H, K, V]`.

    Returns:
      `(o [B, T, H, V], final_state [N, H, K, V] or None)` in the computation dtype, and the
      per-token states as a third result when `token_states`.
    """
    dtype = gates.compute_dtype(q, k, v, g, g_gamma, initial_state)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    log_decay = jnp.zeros(q.shape[:3], dtype)
    if g is not None:
        log_decay = log_decay + g.astype(dtype)
    if g_gamma is not None:
        log_decay = log_decay + g_gamma.astype(dtype)
    return _recurrence(
        q,
        k,
        v,
        log_decay[..., None],
        None,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        state_v_first=state_v_first,
        token_states=token_states,
    )


def gla(
    q, k, v, gk, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=None,
    state_v_first=False, token_states=False,
):  # fmt: skip
    """Gated linear attention with a per-key log decay.

    Args:
      q, k: `[B, T, H, K]`; v: `[B, T, H, V]`; gk: log decay `[B, T, H, K]`.
      scale, initial_state `[N, H, K, V]`, output_final_state, cu_seqlens, chunk_size, state_v_first,
      token_states: as `simple_gla`.

    Returns:
      `(o [B, T, H, V], final_state [N, H, K, V] or None)` in the computation dtype (and the
      per-token states when `token_states`).
    """
    if gk is None:
        raise InvalidArgumentError("gk: required for gla (per-key log decay [B, T, H, K])")
    dtype = gates.compute_dtype(q, k, v, gk, initial_state)
    return _recurrence(
        q.astype(dtype),
        k.astype(dtype),
        v.astype(dtype),
        gk.astype(dtype),
        None,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        state_v_first=state_v_first,
        token_states=token_states,
    )


def kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    chunk_size=None,
    state_v_first=False,
    token_states=False,
    **kda_options,
):
    """Kimi Delta Attention: per-key decay, then a delta-rule correction of strength beta.

    Args:
      q, k: `[B, T, H, K]`; v: `[B, T, HV, V]` with HV a multiple of H (value head j reads
        q/k head j // (HV // H)).
      g: per-key log decay `[B, T, HV, K]`, or the raw gate input when `use_gate_in_kernel`.
      beta: `[B, T, HV]` write strength, or its logits when `use_beta_sigmoid_in_kernel`.
      scale, initial_state `[N, HV, K, V]`, output_final_state, cu_seqlens, chunk_size, state_v_first,
      token_states: as `simple_gla`.
      **kda_options: FLA's in-kernel transforms, by keyword (`gates.prepare_kda` holds them):
        use_qk_l2norm_in_kernel (normalize q and k rows, `gates.l2norm`), use_gate_in_kernel (the
        decay is `gates.kda_gate(g, A_log, dt_bias, lower_bound)`), A_log `[HV]` or `[1, 1, HV, 1]`
        (None with a lower_bound), dt_bias `[HV * K]` (optional), lower_bound (gate parameters),
        use_beta_sigmoid_in_kernel (beta is `sigmoid(beta)`), allow_neg_eigval (beta is
        `2 sigmoid(beta)`), safe_gate (a kernel choice in FLA; no effect here).

    Returns:
      `(o [B, T, HV, V], final_state [N, HV, K, V] or None)` in the computation dtype (and the
      per-token states `[B, T, HV, K, V]` when `token_states`).
    """
    q, k, v, log_decay, beta = gates.prepare_kda(
        q,
        k,
        v,
        g,
        beta,
        initial_state=_to_k_first(initial_state, state_v_first),
        **kda_options,
    )
    return _recurrence(
        q,
        k,
        v,
        log_decay,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        state_v_first=state_v_first,
        token_states=token_states,
    )
