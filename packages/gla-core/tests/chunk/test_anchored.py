"""`gla_core.chunk.anchored.StepDecays` in TPU interpret mode against float64 numpy: the decays of
every chunk of a step, the anchored factors whose products are the gated decays, and the range
check that sends a step to the exact products."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from gla_core.chunk.anchored import StepDecays, default_anchor_range
from gla_core.chunk.gates import GATE_FLOOR, KeyMaskTable
from gla_core.tpu import interpret_params
from gla_ref.testing import TOLERANCES, assert_close

pytestmark = pytest.mark.interpret

CHUNK, CHUNKS, KEYS = 16, 3, 128
TOL = TOLERANCES["float32"]


def _decays(a: np.ndarray, anchor_range: float, interpret: bool) -> dict[str, np.ndarray]:
    """Every StepDecays quantity of the step `a` [n*C, K], computed in a kernel."""
    table = KeyMaskTable(CHUNK)
    names = ("from_start", "to_end", "last_decay", "row_factor", "column_factor", "in_range")
    shapes = {
        "last_decay": (CHUNKS, 1, KEYS),
        "in_range": (1, 1),
        **{n: (CHUNKS, CHUNK, KEYS) for n in ("from_start", "to_end", "row_factor", "column_factor")},
    }

    def kernel(a_ref, table_ref, *out_refs):
        decays = StepDecays(a_ref[...], table_ref, CHUNK, anchor_range)
        for name, ref in zip(names, out_refs, strict=True):
            value = getattr(decays, name)
            ref[...] = jnp.full((1, 1), jnp.where(value, 1.0, 0.0)) if name == "in_range" else value

    outs = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(shapes[n], jnp.float32) for n in names],
        interpret=interpret_params(interpret),
    )(jnp.asarray(a, jnp.float32), table.build())
    return {n: np.asarray(x, np.float64) for n, x in zip(names, outs, strict=True)}


def _gates(scale: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.log(1 / (1 + np.exp(-rng.normal(2.0, 2.0, (CHUNKS * CHUNK, KEYS))))) * scale


def _reference(a: np.ndarray):
    """b_t [n, C, K] and the anchor row's b_m [n, 1, K] in float64."""
    b = np.cumsum(np.asarray(a, np.float32).astype(np.float64).reshape(CHUNKS, CHUNK, KEYS), axis=1)
    m = KeyMaskTable(CHUNK).anchor_row
    return b, b[:, m : m + 1]


def test_decays_and_anchored_products_match_float64(interpret):
    a = _gates(0.5)
    b, bm = _reference(a)
    got = _decays(a, anchor_range=default_anchor_range(jnp.float32), interpret=interpret)
    assert got["in_range"][0, 0] == 1.0, f"max |D| = {np.max(np.abs(b - bm))}"
    assert_close("from_start", got["from_start"], np.exp(b), TOL.output)
    assert_close("to_end", got["to_end"], np.exp(b[:, -1:] - b), TOL.output)
    assert_close("last_decay", got["last_decay"], np.exp(b[:, -1:]), TOL.output)
    # e^{b_t - b_s} for every t >= s of every chunk, as the product of the two factors
    products = got["row_factor"][:, :, None, :] * got["column_factor"][:, None, :, :]  # [n, t, s, K]
    exact = np.exp(b[:, :, None, :] - b[:, None, :, :])
    causal = np.tril(np.ones((CHUNK, CHUNK), bool))[None, :, :, None]
    assert_close("anchored products", np.where(causal, products, 0.0), np.where(causal, exact, 0.0), TOL.output)


@pytest.mark.parametrize("margin", [-1e-3, 1e-3])
def test_in_range_is_decided_at_the_anchor_range(margin, interpret):
    a = _gates(1.0, seed=1)
    b, bm = _reference(a)
    largest = float(np.max(np.abs(b - bm)))
    got = _decays(a, anchor_range=largest * (1 + margin), interpret=interpret)
    assert got["in_range"][0, 0] == (1.0 if margin > 0 else 0.0)


@pytest.mark.parametrize("bad", [np.nan, GATE_FLOOR, -1e4])
def test_out_of_range_or_non_finite_gates_leave_the_anchored_path_with_finite_factors(bad, interpret):
    a = _gates(0.1, seed=2)
    a[CHUNK + 5, 7] = bad
    got = _decays(a, anchor_range=30.0, interpret=interpret)
    assert got["in_range"][0, 0] == 0.0
    if not np.isnan(bad):  # clipped before exp: no factor overflows, however strong the decay
        assert np.all(np.isfinite(got["row_factor"])) and np.all(np.isfinite(got["column_factor"]))


def test_anchor_block_is_the_signed_segment_sum_to_the_anchor_row():
    table = np.asarray(KeyMaskTable(CHUNK).build(), np.float64)
    anchor = table[KeyMaskTable.ANCHOR * CHUNK : (KeyMaskTable.ANCHOR + 1) * CHUNK]
    a = _gates(1.0, seed=3)[:CHUNK].astype(np.float64)
    b = np.cumsum(a, axis=0)
    m = KeyMaskTable(CHUNK).anchor_row
    np.testing.assert_allclose(anchor @ a, b - b[m], rtol=0, atol=1e-12)


def test_scores_only_forms_the_same_anchored_factors(interpret):
    """`scores_only` forms D alone (a third of the segment-sum matmul): the same anchored factors and
    range check as the full decays, and the decays it does not form raise."""
    a = _gates(0.5)
    full = _decays(a, anchor_range=default_anchor_range(jnp.float32), interpret=interpret)
    names = ("row_factor", "column_factor", "in_range")

    def kernel(a_ref, table_ref, *out_refs):
        decays = StepDecays(a_ref[...], table_ref, CHUNK, default_anchor_range(jnp.float32), scores_only=True)
        for name, ref in zip(names, out_refs, strict=True):
            value = getattr(decays, name)
            ref[...] = jnp.full((1, 1), jnp.where(value, 1.0, 0.0)) if name == "in_range" else value
        with pytest.raises(ValueError, match="scores_only"):
            _ = decays.from_start

    shapes = {"in_range": (1, 1), "row_factor": (CHUNKS, CHUNK, KEYS), "column_factor": (CHUNKS, CHUNK, KEYS)}
    outs = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(shapes[n], jnp.float32) for n in names],
        interpret=interpret_params(interpret),
    )(jnp.asarray(a, jnp.float32), KeyMaskTable(CHUNK).build())
    for name, got in zip(names, outs, strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float64), full[name], err_msg=name)


def test_scores_only_needs_an_anchor_range():
    with pytest.raises(ValueError, match="scores_only"):
        StepDecays(jnp.zeros((CHUNK, KEYS)), None, CHUNK, None, scores_only=True)
