"""The `recurrent` implementations of simple_gla and gla: a `lax.scan` over time (the decode path).

Per head, with per-step log decay g_t (a scalar, or one per key) and state S [K, V]:

    S_t = exp(g_t) S_{t-1} + k_t v_tᵀ,    o_t = q_tᵀ S_t      (q already scaled)

The tokens are grouped in checkpoint segments (the chunks of `gla_simple.layout`): the forward
keeps only the state entering each segment; the backward walks the segments in reverse,
recomputes the states inside one segment from its checkpoint and runs the reverse-time
recurrence of the gradients through it:

    dS_t += q_t do_tᵀ;   dq_t = S_t do_t;   dk_t = dS_t v_t;   dv_t = dS_tᵀ k_t;
    dg_t = exp(g_t) Σ_v S_{t-1} ∘ dS_t;   dS_{t-1} = exp(g_t) dS_t

so memory is O(T/C + C) states instead of O(T). Layout inside this module: `[NT, C, Bp*H, X]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import gla_core
from gla_simple import frontend
from gla_simple.layout import Segments
from gla_simple.numerics import einsum
from gla_simple.registration import for_both_ops

PRIORITY = 10
BACKENDS = frozenset({"cpu", "gpu", "tpu"})


def _rows(state: jax.Array) -> jax.Array:
    """[Bp, H, K, V] -> [Bp*H, K, V]."""
    return state.reshape(-1, *state.shape[2:])


def _per_head(states: jax.Array, heads: int) -> jax.Array:
    """[NT, Bp*H, K, V] -> [NT, Bp, H, K, V]."""
    return states.reshape(states.shape[0], -1, heads, *states.shape[2:])


def _update(state, k_t, v_t, g_t):
    """S_t from S_{t-1} [Bp*H, K, V] and one token's k [Bp*H, K], v [Bp*H, V], g [Bp*H, 1|K]."""
    return jnp.exp(g_t)[..., None] * state + k_t[..., None] * v_t[..., None, :]


def _forward(q, k, v, g, initial, segments):
    def token_step(state, token):
        q_t, k_t, v_t, g_t = token
        state = _update(state, k_t, v_t, g_t)
        return state, einsum("nk,nkv->nv", q_t, state)

    def segment_step(state, segment):
        q_n, k_n, v_n, g_n, first_n, sequence_n = segment
        state = jnp.where(first_n, _rows(segments.state_for_chunk(initial, sequence_n)), state)
        after, o_n = lax.scan(token_step, state, (q_n, k_n, v_n, g_n))
        return after, (o_n, state, after)

    carry = jnp.zeros((q.shape[2], q.shape[3], v.shape[3]), q.dtype)
    xs = (q, k, v, g, segments.first, segments.sequence)
    _, (o, before, after) = lax.scan(segment_step, carry, xs)
    final = segments.final_states(_per_head(after, initial.shape[1]), initial)
    return o, final, before


@jax.custom_vjp
def recurrent_attention(q, k, v, g, initial, segments: Segments):
    """The recurrence in segment-major layout (float32 inputs, or float64 throughout).

    Args:
      q: [NT, C, Bp*H, K] queries, already multiplied by the attention scale.
      k: [NT, C, Bp*H, K] keys.
      v: [NT, C, Bp*H, V] values.
      g: [NT, C, Bp*H, 1] scalar or [NT, C, Bp*H, K] per-key log decays (0 in padding slots).
      initial: [N, H, K, V] initial states.
      segments: segment-to-sequence bookkeeping (`gla_simple.layout.Segments`).

    Returns:
      o [NT, C, Bp*H, V] and the final states [N, H, K, V].
    """
    o, final, _ = _forward(q, k, v, g, initial, segments)
    return o, final


def _recurrent_attention_fwd(q, k, v, g, initial, segments):
    o, final, before = _forward(q, k, v, g, initial, segments)
    return (o, final), (q, k, v, g, initial, segments, before)


def _recurrent_attention_bwd(residuals, cotangents):
    q, k, v, g, initial, segments, before = residuals
    do, d_final = cotangents
    scalar_gate = g.shape[-1] == 1

    def state_step(state, token):
        k_t, v_t, g_t = token
        return _update(state, k_t, v_t, g_t), state

    def token_grad_step(d_state, token):
        q_t, k_t, v_t, g_t, do_t, previous = token  # previous: S_{t-1} [Bp*H, K, V]
        decay = jnp.exp(g_t)
        d_state = d_state + q_t[..., None] * do_t[..., None, :]
        # dq = S_t do_t with S_t = exp(g_t) S_{t-1} + k_t v_tᵀ, without forming S_t.
        dq = decay * einsum("nkv,nv->nk", previous, do_t) + k_t * jnp.sum(v_t * do_t, axis=-1, keepdims=True)
        dk = einsum("nkv,nv->nk", d_state, v_t)
        dv = einsum("nkv,nk->nv", d_state, k_t)
        dg = decay * jnp.sum(previous * d_state, axis=-1)
        if scalar_gate:
            dg = jnp.sum(dg, axis=-1, keepdims=True)
        return decay[..., None] * d_state, (dq, dk, dv, dg)

    def segment_grad_step(d_after, segment):
        q_n, k_n, v_n, g_n, do_n, before_n, last_n, sequence_n = segment
        d_after = jnp.where(last_n, _rows(segments.state_for_chunk(d_final, sequence_n)), d_after)
        _, previous = lax.scan(state_step, before_n, (k_n, v_n, g_n))
        tokens = (q_n, k_n, v_n, g_n, do_n, previous)
        d_before, grads = lax.scan(token_grad_step, d_after, tokens, reverse=True)
        return d_before, (*grads, d_before)

    carry = jnp.zeros_like(before[0])
    xs = (q, k, v, g, do, before, segments.last, segments.sequence)
    _, (dq, dk, dv, dg, d_before) = lax.scan(segment_grad_step, carry, xs, reverse=True)
    d_initial = segments.initial_state_grad(_per_head(d_before, initial.shape[1]), d_final)
    return dq, dk, dv, dg, d_initial, None


recurrent_attention.defvjp(_recurrent_attention_fwd, _recurrent_attention_bwd)


def _segment_major(x: jax.Array) -> jax.Array:
    """[Bp, NT, C, H, X] -> [NT, C, Bp*H, X]."""
    batch, chunks, chunk, heads, width = x.shape
    return jnp.transpose(x, (1, 2, 0, 3, 4)).reshape(chunks, chunk, batch * heads, width)


def _sequence_major(x: jax.Array, batch: int) -> jax.Array:
    """[NT, C, Bp*H, X] -> [Bp, NT, C, H, X]."""
    chunks, chunk, rows, width = x.shape
    return jnp.transpose(x.reshape(chunks, chunk, batch, rows // batch, width), (2, 0, 1, 3, 4))


def recurrent_core(q, k, v, g, initial, segments, state_shape):
    """`recurrent_attention` on the shared `[Bp, NT, C, H, X]` layout (see `gla_simple.layout`);
    `initial` is [N, H, K, V] or None (zeros), `state_shape` (N, H, K, V)."""
    if initial is None:
        initial = jnp.zeros(state_shape, q.dtype)
    o, final = recurrent_attention(
        _segment_major(q), _segment_major(k), _segment_major(v), _segment_major(g), initial, segments
    )
    return _sequence_major(o, q.shape[0]), final


def checkpoint_interval(seq_len: int, chunk_size: int) -> int:
    """Tokens per checkpoint segment: at most `chunk_size`, balanced so that fixed-length inputs
    need little padding (T = 1, the decode step, runs a single step)."""
    segments = max(1, -(-seq_len // chunk_size))
    return max(1, -(-seq_len // segments))


def run(args):
    """simple_gla or gla by the recurrence, on the call's validated arguments record."""
    chunk_size = checkpoint_interval(args.q.shape[1], args.chunk_size)
    return frontend.run(recurrent_core, args, chunk_size=chunk_size, causal_non_finite=False)


def implementations() -> list[gla_core.Implementation]:
    description = "lax.scan over time (decode path), checkpointed reverse-scan backward"
    descriptions = {"simple_gla": description, "gla": description}
    return for_both_ops(run, descriptions, name="recurrent", priority=PRIORITY, backends=BACKENDS)
