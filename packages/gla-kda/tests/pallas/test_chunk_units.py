"""Unit tests of the kda `chunk` building blocks (plain jnp on the CPU, no Pallas).

The in-kernel helpers of `gla_kda.pallas.chunk_math` are pure jnp functions, so they are
checked here directly against float64 numpy brute force (explicit [C, C, K] decay tensors,
np.linalg.inv), including decays strong enough that exp(G) underflows. Tolerance:
`TOLERANCES["float32_building_block"]` (float32 arithmetic on O(C) terms). Also the XLA-side layout helpers and the
registration record.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
from gla_kda.chunk import implementations
from gla_kda.pallas import chunk_math as cm
from gla_kda.pallas import layout as kl
from gla_ref.testing import TOLERANCES, assert_close

TOL = TOLERANCES["float32_building_block"].output
C, S, K = 64, 16, 32


def _chunk_data(seed: int, decay_scale: float):
    rng = np.random.default_rng(seed)
    g = -decay_scale * rng.uniform(0.0, 1.0, size=(C, K))
    a, b = rng.standard_normal((C, K)), rng.standard_normal((C, K))
    return g, a, b


def _local(g):
    return np.cumsum(g.reshape(C // S, S, K), axis=1).reshape(C, K)


def _decay_tensor(g):
    """[C, C, K] exp(G_i - G_j) for j <= i (0 above), float64."""
    cum = np.cumsum(g, axis=0)
    diff = cum[:, None, :] - cum[None, :, :]
    causal = np.tril(np.ones((C, C), bool))[:, :, None]
    return np.where(causal, np.exp(np.where(causal, diff, 0.0)), 0.0)


@jax.jit
def _exponents(local):
    d = cm.Decays(local, cm.SubBlocks(C, S))
    return d.cum, d.to_end, d.total, d.before_anchor(2), d.after_block(1)


@functools.partial(jax.jit, static_argnames="unroll")
def _products(local, a, b, p, unroll):
    d = cm.Decays(local, cm.SubBlocks(C, S))
    (scores,) = cm.gated_scores([a], b, d, jnp.float32, unroll)
    (rows,) = cm.gated_rows([p], b, d, jnp.float32, unroll)
    (cols,) = cm.gated_cols([(p, a)], d, jnp.float32, unroll)
    return scores, rows, cols


@pytest.mark.parametrize("decay_scale", [0.5, 40.0])
def test_decay_exponents_match_cumsum(decay_scale):
    g, _, _ = _chunk_data(0, decay_scale)
    cum = np.cumsum(g, axis=0)
    got = _exponents(jnp.asarray(_local(g), jnp.float32))
    before = np.where(np.arange(C)[:, None] < 2 * S, cum[2 * S] - cum, 0.0)
    expected = (cum, cum[-1] - cum, cum[-1:], before, cum[2 * S :] - cum[2 * S - 1])
    for name, x, ref in zip(("cum", "to_end", "total", "before_anchor", "after_block"), got, expected, strict=True):
        assert_close(name, x, ref, TOL)


@pytest.mark.parametrize(("decay_scale", "unroll"), [(0.5, False), (40.0, False), (40.0, True)])
def test_gated_products_and_their_transposes(decay_scale, unroll):
    """gated_scores, gated_rows and gated_cols against explicit [C, C, K] decays, rolled (interpret
    mode) and unrolled with static row picks (TPU)."""
    g, a, b = _chunk_data(1, decay_scale)
    weights = np.tril(np.random.default_rng(2).standard_normal((C, C)))
    decay = _decay_tensor(g)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    scores, rows, cols = _products(f32(_local(g)), f32(a), f32(b), f32(weights), unroll)
    assert_close("scores", scores, np.einsum("id,jd,ijd->ij", a, b, decay), TOL)
    assert_close("rows", rows, np.einsum("ij,jd,ijd->id", weights, b, decay), TOL)
    assert_close("cols", cols, np.einsum("ij,id,ijd->jd", weights, a, decay), TOL)


@pytest.mark.parametrize("unroll", [False, True])
def test_unit_lower_inverse(unroll):
    rng = np.random.default_rng(3)
    a = np.tril(rng.uniform(-0.5, 0.5, size=(C, C)), -1)
    inverse = jax.jit(lambda x: cm.unit_lower_inverse(x, cm.SubBlocks(C, S), unroll))(jnp.asarray(a, jnp.float32))
    assert_close("(I + A)^-1", inverse, np.linalg.inv(np.eye(C) + a), TOL)


def test_row_column_transposes():
    row = jnp.arange(8, dtype=jnp.float32)[None, :]
    np.testing.assert_array_equal(cm.row_to_column(row), row.T)
    np.testing.assert_array_equal(cm.column_to_row(row.T), row)


def test_chunk_grad_to_local_is_the_transpose_of_the_cumsum_map():
    """dL = J^T dG for G = within-chunk cumsum written in terms of the local cumsum L."""
    rng = np.random.default_rng(4)
    shape, chunk, sub = (1, 2, 2 * C, 3), C, S

    def chunk_cum_from_local(local):
        blocks = local.reshape(1, 2, 2, C // S, S, 3)
        before = jnp.cumsum(blocks[..., -1, :], axis=3) - blocks[..., -1, :]
        return (blocks + before[..., None, :]).reshape(shape)

    g = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    local = kl.local_cumsum(g, sub)
    chunk_cum = jnp.cumsum(g.reshape(1, 2, 2, C, 3), axis=3).reshape(shape)
    assert_close("G from L", chunk_cum_from_local(local), chunk_cum, TOL)
    dg_chunk = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    (expected,) = jax.vjp(chunk_cum_from_local, local)[1](dg_chunk)
    assert_close("dL", kl.chunk_grad_to_local(dg_chunk, chunk, sub), expected, TOL)


@pytest.mark.parametrize("cu_seqlens", [None, [0, 5, 5, 70, 90]])
def test_kernel_layout_round_trip(cu_seqlens):
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((1, 90, 3, 20)), jnp.float32)
    cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32)
    layout = kl.make_layout(90, 20, 20, 32, cu)
    kernel = kl.to_kernel(x, layout, layout.key_pad)
    assert kernel.shape == (1, 3, layout.padded_len, 128)
    np.testing.assert_array_equal(kl.from_kernel(kernel, layout, 20), x)
    meta = kl.chunk_meta(layout, 1)
    assert meta.first.shape == meta.last.shape == meta.seq.shape == (layout.num_chunks,)


def test_registration_and_explain_on_cpu():
    (impl,) = implementations()
    assert (impl.op, impl.name, impl.priority, impl.backends, impl.interpretable) == (
        "kda",
        "chunk",
        100,
        frozenset({"tpu"}),
        True,
    )
    q = jax.ShapeDtypeStruct((1, 64, 2, 32), jnp.float32)
    g = jax.ShapeDtypeStruct((1, 64, 2, 32), jnp.float32)
    beta = jax.ShapeDtypeStruct((1, 64, 2), jnp.float32)
    with gla_core.use(backend="tpu"):
        assert gla_core.explain("kda", q, q, q, g=g, beta=beta).winner.name == "chunk"
    with jax.enable_x64(True):
        q64 = jax.ShapeDtypeStruct((1, 64, 2, 32), jnp.float64)
        g64 = jax.ShapeDtypeStruct((1, 64, 2, 32), jnp.float64)
        beta64 = jax.ShapeDtypeStruct((1, 64, 2), jnp.float64)
        with gla_core.use(backend="tpu"):
            resolution = gla_core.explain("kda", q64, q64, q64, g=g64, beta=beta64)
    declined = {c.implementation.name: c.reason for c in resolution.candidates}
    assert "float64" in declined["chunk"]
