"""Building blocks of the XLA implementations against direct float64 formulas."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
from gla_core import varlen
from gla_ref import testing
from gla_simple import intra, layout, numerics
from gla_simple.recurrent import checkpoint_interval

BLOCK_TOL = testing.TOLERANCES["float32_building_block"].output


def _direct(q, k, b, d_scores):
    """float64 A[i, j] = Σ_d q_id k_jd exp(b_id - b_jd) (j <= i) and the gradients of Σ d_scores ∘ A."""
    chunk = q.shape[-2]
    mask = np.tril(np.ones((chunk, chunk), bool))
    exponent = np.where(mask[..., None], b[..., :, None, :] - b[..., None, :, :], -np.inf)
    decay = np.exp(exponent)  # [..., C, C, 1|K]
    terms = q[..., :, None, :] * k[..., None, :, :] * decay
    scores = terms.sum(-1)
    weighted = d_scores[..., None] * decay
    dq = (weighted * k[..., None, :, :]).sum(-2)
    dk = (weighted * q[..., :, None, :]).sum(-3)
    off_diagonal = d_scores[..., None] * terms * ~np.eye(chunk, dtype=bool)[..., None]
    d_b = off_diagonal.sum(-2) - off_diagonal.sum(-3)  # ∂/∂b_i of the exponents b_i - b_j
    if b.shape[-1] == 1:
        d_b = d_b.sum(-1, keepdims=True)
    return scores, dq, dk, d_b


@jax.jit
def _intra(q, k, g, d_scores):
    scores = intra.scores(q, k, g)
    return (scores, *intra.score_grads(d_scores, q, k, g, scores))


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("keys_of_gate", ["scalar", "per-key"])
def test_intra_scores_and_grads(chunk, keys_of_gate):
    """Strong decays (up to -10 per step): exponents reach -640 inside a chunk of 64."""
    decay_scale = 10.0
    rng = np.random.default_rng(chunk)
    key_dim = 24
    q, k = rng.standard_normal((2, 3, chunk, key_dim))
    d_scores = np.tril(rng.standard_normal((3, chunk, chunk)))
    gate_dim = 1 if keys_of_gate == "scalar" else key_dim
    g = -decay_scale * rng.uniform(0.0, 1.0, (3, chunk, gate_dim))
    b = np.cumsum(g, axis=-2)
    expected = _direct(q, k, b, d_scores)
    results = _intra(*(jnp.asarray(x, jnp.float32) for x in (q, k, g, d_scores)))
    for name, value, reference in zip(("scores", "dq", "dk", "d_b"), results, expected, strict=True):
        assert bool(jnp.all(jnp.isfinite(value))), name
        testing.assert_close(name, value, reference, BLOCK_TOL)


def test_chunk_cumsums():
    x = np.random.default_rng(0).standard_normal((2, 16, 3)).astype(np.float32)
    testing.assert_close("inclusive", numerics.chunk_cumsum(jnp.asarray(x)), np.cumsum(x, axis=1), BLOCK_TOL)
    exclusive = np.cumsum(x, axis=1) - x
    testing.assert_close("exclusive", numerics.chunk_cumsum(jnp.asarray(x), exclusive=True), exclusive, BLOCK_TOL)
    reverse = np.flip(np.cumsum(np.flip(x, 1), axis=1), 1)
    testing.assert_close("reverse", numerics.reverse_chunk_cumsum(jnp.asarray(x)), reverse, BLOCK_TOL)


@pytest.mark.parametrize("cu_seqlens", [None, [0, 0, 5, 6, 40, 40]])
def test_chunk_layout_round_trip(cu_seqlens):
    batch = 2 if cu_seqlens is None else 1
    x = jnp.asarray(np.random.default_rng(1).standard_normal((batch, 40, 3, 5)), jnp.float32)
    cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32)

    @jax.jit
    def round_trip(x, cu):
        sequences = layout.chunk_sequences(batch, 40, 16, cu)
        chunks = sequences.split(x)
        return chunks, sequences.merge(chunks), sequences.segments()

    chunks, merged, segments = round_trip(x, cu)
    num_chunks = 3 if cu_seqlens is None else varlen.num_padded_chunks(40, len(cu_seqlens) - 1, 16)
    assert chunks.shape == (batch, num_chunks, 16, 3, 5)
    np.testing.assert_array_equal(merged, x)
    if cu_seqlens is not None:
        # 5, 1 and 34 tokens own 1, 1 and 3 chunks; the two empty sequences none.
        np.testing.assert_array_equal(segments.empty, [True, False, False, False, True])
        assert int(segments.first.sum()) == 3 and int(segments.last.sum()) == 3


@pytest.mark.parametrize(("seq_len", "chunk", "expected"), [(1, 64, 1), (64, 64, 64), (100, 64, 50), (129, 64, 43)])
def test_checkpoint_interval(seq_len, chunk, expected):
    assert checkpoint_interval(seq_len, chunk) == expected


@pytest.mark.parametrize("impl", ["xla", "recurrent"])
def test_no_tokens_keeps_the_initial_states(impl):
    """T = 0 (all packed sequences empty): the final states are the initial states, and so is their gradient."""
    q = jnp.zeros((1, 0, 2, 8))
    initial = jnp.asarray(np.random.default_rng(2).standard_normal((2, 2, 8, 8)), jnp.float32)
    cu = jnp.asarray([0, 0, 0], jnp.int32)

    def final_sum(h0):
        o, final = gla_core.dispatch(
            "gla", q, q, q, gk=q, impl=impl, initial_state=h0, output_final_state=True, cu_seqlens=cu
        )
        assert o.shape == (1, 0, 2, 8)
        return jnp.sum(final * final), final

    (_, final), grad = jax.jit(jax.value_and_grad(final_sum, has_aux=True))(initial)
    np.testing.assert_array_equal(final, initial)
    testing.assert_close("d initial_state", grad, 2 * initial, testing.TOLERANCES["float32_rearranged"].grad)
