"""Chunked gated linear attention in plain XLA, with a hand-written backward.

Per head, with per-step log decays g_t (<= 0) and state S [K, V]:

    S_t = exp(g_t) S_{t-1} + k_t v_tᵀ,    o_t = q_tᵀ S_t      (q already scaled)

The sequence is cut into chunks of C steps. With b the inclusive cumulative decay inside a
chunk (anchored at its start, so every exponent below is <= 0) and G = b at the chunk end:

    U_n      = (k ∘ exp(G - b))ᵀ v                         [K, V] chunk contribution (GEMM)
    h_{n+1}  = exp(G_n) ∘ h_n + U_n                        state scan over chunks (elementwise)
    o        = (q ∘ exp(b)) h_n + A v                      inter + intra (GEMMs; A from `intra`)

G - b_t is summed directly from the decays after t (not as a difference of cumulative sums,
which loses precision when they are large); see `intra` for the intra-chunk exponents.

The decay is a scalar per step (`g` [..., C, 1], simple_gla) or per key (`g` [..., C, K], gla);
the formulas are the same with broadcasting, only the intra-chunk scores differ. Only the state
scan is sequential (NT short steps); everything else is batched over chunks, batch and heads.

The backward recomputes the forward intermediates from the inputs (nothing but the inputs is
saved) and runs the state-gradient scan in reverse:

    dh_n     = (q ∘ exp(b))ᵀ do + exp(G_n) ∘ dh_{n+1}      (dh_{n+1}: gradient of h_{n+1})

The gate gradient collects, for each step s, the exponents that contain g_s: b_i for i >= s
(inter output, intra rows), G - b_t for t < s (chunk contribution) and G (state decay):

    dg = reverse-cumsum(q̄ ∘ dq̄ + d b_intra) + exclusive-cumsum(k̄ ∘ dk̄) + exp(G) ∘ Σ_v h_n ∘ dh_{n+1}

with q̄ = q ∘ exp(b), k̄ = k ∘ exp(G - b) and dq̄, dk̄ their gradients. Every term is as small
as the decay factor it multiplies, so under strong decay (tiny true gradients) nothing O(1)
cancels; the algebraically equal form q ∘ dq - k ∘ dk loses all precision there.

Layout inside this module: chunk-major `[NT, Bp*H, C, X]` (the scan runs over the leading axis).
Batch and heads share one axis: XLA:CPU in jax 0.10.2 can crash (segfault) on rank-7
multiply-reduce fusions with a size-1 dimension (jax-ml/jax#40412), and `Bp` is 1 for varlen
input, so every array here stays at rank <= 5 without degenerate batch axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from gla_simple import intra
from gla_simple.layout import Segments
from gla_simple.numerics import chunk_cumsum, einsum, reverse_chunk_cumsum


def _rows(state: jax.Array) -> jax.Array:
    """[Bp, H, K, V] -> [Bp*H, K, V]."""
    return state.reshape(-1, *state.shape[2:])


def _per_head(states: jax.Array, heads: int) -> jax.Array:
    """[NT, Bp*H, K, V] -> [NT, Bp, H, K, V]."""
    return states.reshape(states.shape[0], -1, heads, *states.shape[2:])


def _state_scan(decay, contribution, initial, segments: Segments):
    """States entering every chunk [NT, Bp*H, K, V], resetting at sequence starts.

    decay [NT, Bp*H, 1|K] is exp(G_n), contribution [NT, Bp*H, K, V] is U_n.
    """

    def step(state, chunk):
        decay_n, contribution_n, first_n, sequence_n = chunk
        state = jnp.where(first_n, _rows(segments.state_for_chunk(initial, sequence_n)), state)
        return decay_n[..., None] * state + contribution_n, state

    carry = jnp.zeros_like(contribution[0])
    _, before = lax.scan(step, carry, (decay, contribution, segments.first, segments.sequence))
    return before


def _state_grad_scan(decay, from_outputs, d_final, segments: Segments):
    """Reverse scan of the state gradient.

    from_outputs [NT, Bp*H, K, V] is (q ∘ exp(b))ᵀ do of every chunk. Returns the gradient of the
    state after every chunk [NT, Bp*H, K, V]; the gradient of the state entering chunk n is
    from_outputs_n + exp(G_n) ∘ d_after_n (not stacked here: only sequence starts need it).
    """

    def step(d_after, chunk):
        decay_n, from_outputs_n, last_n, sequence_n = chunk
        d_after = jnp.where(last_n, _rows(segments.state_for_chunk(d_final, sequence_n)), d_after)
        return from_outputs_n + decay_n[..., None] * d_after, d_after

    carry = jnp.zeros_like(from_outputs[0])
    xs = (decay, from_outputs, segments.last, segments.sequence)
    _, d_after = lax.scan(step, carry, xs, reverse=True)
    return d_after


def _forward_intermediates(q, k, v, g, initial, segments):
    b = chunk_cumsum(g)  # Σ_{s <= t} g_s, [NT, Bp*H, C, 1|K]
    to_end = reverse_chunk_cumsum(g, exclusive=True)  # Σ_{s > t} g_s = G - b_t, summed directly
    decay = jnp.exp(b[..., -1, :])  # exp(G) [NT, Bp*H, 1|K]
    q_decayed = q * jnp.exp(b)
    k_decayed = k * jnp.exp(to_end)
    contribution = einsum("...ck,...cv->...kv", k_decayed, v)
    before = _state_scan(decay, contribution, initial, segments)
    after = decay[..., None] * before + contribution
    return b, to_end, q_decayed, k_decayed, decay, before, after


def _forward(q, k, v, g, initial, segments):
    _, _, q_decayed, _, _, before, after = _forward_intermediates(q, k, v, g, initial, segments)
    scores = intra.scores(q, k, g)
    o = einsum("...ck,...kv->...cv", q_decayed, before) + einsum("...ij,...jv->...iv", scores, v)
    return o, segments.final_states(_per_head(after, initial.shape[1]), initial)


@jax.custom_vjp
def chunked_attention(q, k, v, g, initial, segments):
    """Chunked gated linear attention on chunk-major float32 inputs.

    Args:
      q: [NT, Bp*H, C, K] queries, already multiplied by the attention scale.
      k: [NT, Bp*H, C, K] keys.
      v: [NT, Bp*H, C, V] values.
      g: [NT, Bp*H, C, 1] scalar or [NT, Bp*H, C, K] per-key log decays (0 in padding slots).
      initial: [N, H, K, V] initial states.
      segments: chunk-to-sequence bookkeeping (`gla_simple.layout.Segments`).

    Returns:
      o [NT, Bp*H, C, V] and the final states [N, H, K, V], float32.
    """
    return _forward(q, k, v, g, initial, segments)


def _chunked_attention_fwd(q, k, v, g, initial, segments):
    return _forward(q, k, v, g, initial, segments), (q, k, v, g, initial, segments)


def _chunked_attention_bwd(residuals, cotangents):
    q, k, v, g, initial, segments = residuals
    do, d_final = cotangents
    b, to_end, q_decayed, k_decayed, decay, before, _ = _forward_intermediates(q, k, v, g, initial, segments)

    from_outputs = einsum("...ck,...cv->...kv", q_decayed, do)
    d_after = _state_grad_scan(decay, from_outputs, d_final, segments)
    d_before = from_outputs + decay[..., None] * d_after
    d_initial = segments.initial_state_grad(_per_head(d_before, initial.shape[1]), d_final)

    scores = intra.scores(q, k, g)
    d_scores = einsum("...iv,...jv->...ij", do, v)
    dq_intra, dk_intra, d_b_intra = intra.score_grads(d_scores, q, k, g, scores)
    dq_decayed = einsum("...cv,...kv->...ck", do, before)
    dk_decayed = einsum("...cv,...kv->...ck", v, d_after)
    dq = jnp.exp(b) * dq_decayed + dq_intra
    dk = jnp.exp(to_end) * dk_decayed + dk_intra
    dv = einsum("...ck,...kv->...cv", k_decayed, d_after) + einsum("...ij,...iv->...jv", scores, do)

    from_rows = q_decayed * dq_decayed  # exponents b_i
    from_columns = k_decayed * dk_decayed  # exponents G - b_t
    from_state = decay * jnp.sum(before * d_after, axis=-1)  # exponent G, [NT, Bp*H, 1|K]
    if intra.is_scalar_gate(g):
        from_rows = jnp.sum(from_rows, axis=-1, keepdims=True)
        from_columns = jnp.sum(from_columns, axis=-1, keepdims=True)
        from_state = jnp.sum(from_state, axis=-1, keepdims=True)
    dg = (
        reverse_chunk_cumsum(from_rows + d_b_intra)
        + chunk_cumsum(from_columns, exclusive=True)
        + from_state[..., None, :]
    )
    return dq, dk, dv, dg, d_initial, None


chunked_attention.defvjp(_chunked_attention_fwd, _chunked_attention_bwd)


def _chunk_major(x: jax.Array) -> jax.Array:
    """[Bp, NT, C, H, X] -> [NT, Bp*H, C, X]."""
    batch, chunks, chunk, heads, width = x.shape
    return jnp.transpose(x, (1, 0, 3, 2, 4)).reshape(chunks, batch * heads, chunk, width)


def _sequence_major(x: jax.Array, batch: int) -> jax.Array:
    """[NT, Bp*H, C, X] -> [Bp, NT, C, H, X]."""
    chunks, rows, chunk, width = x.shape
    return jnp.transpose(x.reshape(chunks, batch, rows // batch, chunk, width), (1, 0, 3, 2, 4))


def chunked_core(q, k, v, g, initial, segments):
    """`chunked_attention` on the shared `[Bp, NT, C, H, X]` layout (see `gla_simple.layout`)."""
    o, final = chunked_attention(_chunk_major(q), _chunk_major(k), _chunk_major(v), _chunk_major(g), initial, segments)
    return _sequence_major(o, q.shape[0]), final
