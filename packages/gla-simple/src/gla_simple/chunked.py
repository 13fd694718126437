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

Zero states and cotangents are kept structural (None), never materialized where a dot would
read them: XLA:CPU in jaxlib 0.10.2 miscompiles a `__ynn_fusion` that holds a reduction and a
dot whose operand is a broadcast scalar (the dot reads uninitialised memory; minimal form
`jnp.sum(x, -1, keepdims=True) + x @ jnp.zeros((64, 64))` under `jax.jit`). A zero initial
state entering a single chunk, or a zero (unused) output cotangent, would be exactly such an
operand once XLA folds the one-step scan, so the terms they feed are skipped instead.

Layout inside this module: chunk-major `[NT, Bp*H, C, X]` (the scan runs over the leading axis).
Batch and heads share one axis: XLA:CPU in jax 0.10.2 can crash (segfault) on rank-7
multiply-reduce fusions with a size-1 dimension (jax-ml/jax#40412), and `Bp` is 1 for varlen
input, so every array here stays at rank <= 5 without degenerate batch axes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

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


def _total(*terms: jax.Array | None) -> jax.Array | None:
    """The sum of the terms that are not None (None stands for an exact zero); None if all are."""
    present = [term for term in terms if term is not None]
    return functools.reduce(jnp.add, present) if present else None


def _state_scan(decay, contribution, initial, segments: Segments):
    """States entering every chunk [NT, Bp*H, K, V], resetting at sequence starts, or None when
    every one is zero (a single chunk and no initial state).

    decay [NT, Bp*H, 1|K] is exp(G_n), contribution [NT, Bp*H, K, V] is U_n, initial
    [N, H, K, V] or None (zeros).
    """
    if initial is None and decay.shape[0] == 1:
        return None

    def step(state, chunk):
        decay_n, contribution_n, first_n, sequence_n = chunk
        entering = 0.0 if initial is None else _rows(segments.state_for_chunk(initial, sequence_n))
        state = jnp.where(first_n, entering, state)
        return decay_n[..., None] * state + contribution_n, state

    carry = jnp.zeros_like(contribution[0])
    _, before = lax.scan(step, carry, (decay, contribution, segments.first, segments.sequence))
    return before


def _state_grad_scan(decay, from_outputs, d_final, segments: Segments, state_rows_shape):
    """Reverse scan of the state gradient: the gradient of the state after every chunk
    [NT, Bp*H, K, V], or None when it is zero.

    from_outputs [NT, Bp*H, K, V] is (q ∘ exp(b))ᵀ do of every chunk (None: do is zero), d_final
    [N, H, K, V] the final-state cotangent (None: zero), state_rows_shape (Bp*H, K, V). The
    gradient of the state entering chunk n is from_outputs_n + exp(G_n) ∘ d_after_n (not stacked
    here: only sequence starts need it).
    """
    if d_final is None and (from_outputs is None or decay.shape[0] == 1):
        return None

    def step(d_after, chunk):
        decay_n, from_outputs_n, last_n, sequence_n = chunk
        leaving = 0.0 if d_final is None else _rows(segments.state_for_chunk(d_final, sequence_n))
        d_after = jnp.where(last_n, leaving, d_after)
        d_before = decay_n[..., None] * d_after
        return (d_before if from_outputs_n is None else from_outputs_n + d_before), d_after

    carry = jnp.zeros(state_rows_shape, decay.dtype)
    xs = (decay, from_outputs, segments.last, segments.sequence)
    _, d_after = lax.scan(step, carry, xs, reverse=True)
    return d_after


class _Intermediates(NamedTuple):
    b: jax.Array  # Σ_{s <= t} g_s inside the chunk, [NT, Bp*H, C, 1|K]
    to_end: jax.Array  # Σ_{s > t} g_s = G - b_t, summed directly
    q_decayed: jax.Array  # q ∘ exp(b)
    k_decayed: jax.Array  # k ∘ exp(G - b)
    decay: jax.Array  # exp(G), [NT, Bp*H, 1|K]
    before: jax.Array | None  # states entering every chunk, None when all zero
    after: jax.Array  # states after every chunk


def _forward_intermediates(q, k, v, g, initial, segments) -> _Intermediates:
    b = chunk_cumsum(g)
    to_end = reverse_chunk_cumsum(g, exclusive=True)
    decay = jnp.exp(b[..., -1, :])
    q_decayed = q * jnp.exp(b)
    k_decayed = k * jnp.exp(to_end)
    contribution = einsum("...ck,...cv->...kv", k_decayed, v)
    before = _state_scan(decay, contribution, initial, segments)
    after = contribution if before is None else decay[..., None] * before + contribution
    return _Intermediates(b, to_end, q_decayed, k_decayed, decay, before, after)


def _forward(q, k, v, g, initial, segments, heads):
    x = _forward_intermediates(q, k, v, g, initial, segments)
    o = einsum("...ij,...jv->...iv", intra.scores(q, k, g), v)
    if x.before is not None:
        o = o + einsum("...ck,...kv->...cv", x.q_decayed, x.before)
    return o, segments.final_states(_per_head(x.after, heads), initial)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def chunked_attention(q, k, v, g, initial, segments, heads):
    """Chunked gated linear attention on chunk-major inputs (float32, or float64 throughout).

    Args:
      q: [NT, Bp*H, C, K] queries, already multiplied by the attention scale.
      k: [NT, Bp*H, C, K] keys.
      v: [NT, Bp*H, C, V] values.
      g: [NT, Bp*H, C, 1] scalar or [NT, Bp*H, C, K] per-key log decays, finite or nan (clamped
        at `numerics.LOG_DECAY_FLOOR`), 0 in padding slots.
      initial: [N, H, K, V] initial states, or None for zeros.
      segments: chunk-to-sequence bookkeeping (`gla_simple.layout.Segments`).
      heads: H (static).

    Returns:
      o [NT, Bp*H, C, V] and the final states [N, H, K, V].
    """
    return _forward(q, k, v, g, initial, segments, heads)


def _primal_values(args):
    is_primal = lambda x: isinstance(x, jax.custom_derivatives.CustomVJPPrimal)
    return jax.tree.map(lambda x: x.value if is_primal(x) else x, args, is_leaf=is_primal)


def _nonzero(cotangent):
    return None if isinstance(cotangent, jax.custom_derivatives.SymbolicZero) else cotangent


def _chunked_attention_fwd(q, k, v, g, initial, segments, heads):
    q, k, v, g, initial, segments = _primal_values((q, k, v, g, initial, segments))
    return _forward(q, k, v, g, initial, segments, heads), (q, k, v, g, initial, segments)


def _chunked_attention_bwd(heads, residuals, cotangents):
    q, k, v, g, initial, segments = residuals
    do, d_final = (_nonzero(c) for c in cotangents)
    x = _forward_intermediates(q, k, v, g, initial, segments)

    state_rows_shape = (q.shape[1], q.shape[-1], v.shape[-1])  # (Bp*H, K, V)
    from_outputs = None if do is None else einsum("...ck,...cv->...kv", x.q_decayed, do)
    d_after = _state_grad_scan(x.decay, from_outputs, d_final, segments, state_rows_shape)
    d_initial = None
    if initial is not None:
        d_before = _total(from_outputs, None if d_after is None else x.decay[..., None] * d_after)
        d_before = jnp.zeros((q.shape[0], *state_rows_shape), q.dtype) if d_before is None else d_before
        d_initial = segments.initial_state_grad(
            _per_head(d_before, heads), jnp.zeros_like(initial) if d_final is None else d_final
        )

    dq_decayed = dk_decayed = from_state = None
    dq_intra = dk_intra = d_b_intra = dv_intra = None
    if do is not None:
        scores = intra.scores(q, k, g)
        d_scores = einsum("...iv,...jv->...ij", do, v)
        dq_intra, dk_intra, d_b_intra = intra.score_grads(d_scores, q, k, g, scores)
        dv_intra = einsum("...ij,...iv->...jv", scores, do)
        if x.before is not None:
            dq_decayed = einsum("...cv,...kv->...ck", do, x.before)
    if d_after is not None:
        dk_decayed = einsum("...cv,...kv->...ck", v, d_after)
        if x.before is not None:
            from_state = x.decay * jnp.sum(x.before * d_after, axis=-1)  # exponent G, [NT, Bp*H, 1|K]

    zeros = jnp.zeros_like
    dq = _total(None if dq_decayed is None else jnp.exp(x.b) * dq_decayed, dq_intra)
    dk = _total(None if dk_decayed is None else jnp.exp(x.to_end) * dk_decayed, dk_intra)
    dv = _total(None if d_after is None else einsum("...ck,...kv->...cv", x.k_decayed, d_after), dv_intra)

    from_rows = None if dq_decayed is None else x.q_decayed * dq_decayed  # exponents b_i
    from_columns = None if dk_decayed is None else x.k_decayed * dk_decayed  # exponents G - b_t
    if intra.is_scalar_gate(g):
        reduce = lambda t: None if t is None else jnp.sum(t, axis=-1, keepdims=True)
        from_rows, from_columns, from_state = reduce(from_rows), reduce(from_columns), reduce(from_state)
    rows = _total(from_rows, d_b_intra)
    dg = _total(
        None if rows is None else reverse_chunk_cumsum(rows),
        None if from_columns is None else chunk_cumsum(from_columns, exclusive=True),
        None if from_state is None else jnp.broadcast_to(from_state[..., None, :], g.shape),
    )
    return (
        zeros(q) if dq is None else dq,
        zeros(k) if dk is None else dk,
        zeros(v) if dv is None else dv,
        zeros(g) if dg is None else dg,
        d_initial,
        None,
    )


chunked_attention.defvjp(_chunked_attention_fwd, _chunked_attention_bwd, symbolic_zeros=True)


def _chunk_major(x: jax.Array) -> jax.Array:
    """[Bp, NT, C, H, X] -> [NT, Bp*H, C, X]."""
    batch, chunks, chunk, heads, width = x.shape
    return jnp.transpose(x, (1, 0, 3, 2, 4)).reshape(chunks, batch * heads, chunk, width)


def _sequence_major(x: jax.Array, batch: int) -> jax.Array:
    """[NT, Bp*H, C, X] -> [Bp, NT, C, H, X]."""
    chunks, rows, chunk, width = x.shape
    return jnp.transpose(x.reshape(chunks, batch, rows // batch, chunk, width), (1, 0, 3, 2, 4))


def chunked_core(q, k, v, g, initial, segments, state_shape):
    """`chunked_attention` on the shared `[Bp, NT, C, H, X]` layout (see `gla_simple.layout`);
    `state_shape` is (N, H, K, V)."""
    heads = state_shape[1]
    o, final = chunked_attention(
        _chunk_major(q), _chunk_major(k), _chunk_major(v), _chunk_major(g), initial, segments, heads
    )
    return _sequence_major(o, q.shape[0]), final
