"""`gla_core.chunk.products` in TPU interpret mode against float64 numpy: the gated intra-chunk
products (scores and the strictly lower left/right products) of the blocked form, whose range check
holds for decays too strong for the chunk-wide anchored form, and of the exact level products."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from gla_core.chunk.anchored import default_anchor_range
from gla_core.chunk.gates import KeyMaskTable
from gla_core.chunk.products import BlockedProducts, LevelProducts
from gla_core.errors import InvalidArgumentError
from gla_core.tpu import interpret_params
from gla_ref.testing import TOLERANCES, assert_close

pytestmark = pytest.mark.interpret

CHUNK, CHUNKS, KEYS = 64, 2, 128
RANGE = default_anchor_range(jnp.float32)
TOL = TOLERANCES["float32"]


def _inputs(step_decay: float, seed: int) -> dict[str, np.ndarray]:
    """x, y, w and per-step log decays a ~ -step_decay * U(0.5, 1.5) for CHUNKS chunks."""
    rng = np.random.default_rng(seed)
    shape = (CHUNKS, CHUNK, KEYS)
    w = np.tril(rng.normal(size=(CHUNKS, CHUNK, CHUNK)), -1)
    a = -step_decay * rng.uniform(0.5, 1.5, shape)
    return {"x": rng.normal(size=shape), "y": rng.normal(size=shape), "w": w, "a": a}


def _reference(x, y, w, a):
    """scores [n, C, C], left and right [n, C, K] in float64 from the float32-rounded inputs."""
    x, y, w, a = (np.asarray(v, np.float32).astype(np.float64) for v in (x, y, w, a))
    b = np.cumsum(a, axis=1)
    decay = np.exp(np.minimum(b[:, :, None, :] - b[:, None, :, :], 0.0))  # [n, t, s, K], used for s <= t
    causal = np.tril(np.ones((CHUNK, CHUNK)))[None]
    scores = np.einsum("ntk,nsk,ntsk->nts", x, y, decay) * causal
    left = np.einsum("nts,nsk,ntsk->ntk", w, y, decay)
    right = np.einsum("nts,ntk,ntsk->nsk", w, x, decay)
    return scores, left, right


def _products(kind: str, inputs: dict[str, np.ndarray], interpret: bool) -> dict[str, np.ndarray]:
    """scores, left, right and in_range of the `kind` products ("blocked" or "level"), in a kernel."""

    def kernel(x_ref, y_ref, w_ref, a_ref, table_ref, scores_ref, left_ref, right_ref, in_range_ref):
        a = a_ref[...].reshape(CHUNKS * CHUNK, KEYS)
        if kind == "blocked":
            products = BlockedProducts(a, table_ref, CHUNK, RANGE, jnp.float32)
            in_range = products.in_range
        else:
            products = LevelProducts(a, table_ref, CHUNK, jnp.float32)
            in_range = True
        scores_ref[...] = products.scores(x_ref[...], y_ref[...])
        left_ref[...], right_ref[...] = products.left_right_strict(w_ref[...], y_ref[...], x_ref[...])
        in_range_ref[...] = jnp.full((1, 1), jnp.where(in_range, 1.0, 0.0))

    shapes = [(CHUNKS, CHUNK, CHUNK), (CHUNKS, CHUNK, KEYS), (CHUNKS, CHUNK, KEYS), (1, 1)]
    outs = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes],
        interpret=interpret_params(interpret),
    )(*(jnp.asarray(inputs[name], jnp.float32) for name in ("x", "y", "w", "a")), KeyMaskTable(CHUNK).build())
    names = ("scores", "left", "right", "in_range")
    return {name: np.asarray(x, np.float64) for name, x in zip(names, outs, strict=True)}


def _largest_anchored_exponent(a: np.ndarray, sub: int) -> float:
    """max |b_t - b_m(t)| over the blocks of `sub` steps (m(t) the block's middle row), float64."""
    b = np.cumsum(a, axis=1).reshape(CHUNKS, CHUNK // sub, sub, KEYS)
    middle = max(sub // 2 - 1, 0)
    return float(np.max(np.abs(b - b[:, :, middle : middle + 1])))


def _assert_matches_reference(got, inputs, label):
    scores, left, right = _reference(**inputs)
    assert_close(f"scores ({label})", got["scores"], scores, TOL.output)
    assert_close(f"left ({label})", got["left"], left, TOL.output)
    assert_close(f"right ({label})", got["right"], right, TOL.output)


@pytest.mark.parametrize("kind", ["blocked", "level"])
def test_products_match_float64_where_the_chunk_wide_anchor_is_out_of_range(kind, interpret):
    """Decays of ~0.5 per step: a whole chunk anchored at its middle row spans |D| ~ 16 > the float32
    range 8, a sub-block of 16 steps |D'| ~ 4 within it."""
    inputs = _inputs(0.5, seed=0)
    sub = KeyMaskTable(CHUNK).sub_block
    assert _largest_anchored_exponent(inputs["a"], CHUNK) > RANGE >= _largest_anchored_exponent(inputs["a"], sub)
    got = _products(kind, inputs, interpret)
    assert got["in_range"][0, 0] == 1.0
    _assert_matches_reference(got, inputs, kind)


def test_a_reset_between_sub_blocks_stays_in_range_and_exact(interpret):
    """A hard reset on the first step of a sub-block lies outside every sub-block's anchored
    exponents: the blocked products stay in range and take it through the exact level factors."""
    inputs = _inputs(0.5, seed=1)
    sub = KeyMaskTable(CHUNK).sub_block
    inputs["a"][:, 2 * sub, :] = -60.0
    got = _products("blocked", inputs, interpret)
    assert got["in_range"][0, 0] == 1.0
    _assert_matches_reference(got, inputs, "reset between sub-blocks")


@pytest.mark.parametrize("bad", [np.nan, -60.0])
def test_a_reset_or_nan_inside_a_sub_block_is_out_of_range_with_finite_products(bad, interpret):
    inputs = _inputs(0.5, seed=2)
    inputs["a"][1, 5, 3] = bad
    got = _products("blocked", inputs, interpret)
    assert got["in_range"][0, 0] == 0.0
    if not np.isnan(bad):  # the exponents are clipped before exp: nothing overflows
        assert all(np.all(np.isfinite(got[name])) for name in ("scores", "left", "right"))


def test_blocked_products_are_in_range_for_decays_the_chunk_anchor_is_not(interpret):
    """The range check against its float64 definition, on both sides of the anchor range."""
    inputs = _inputs(0.5, seed=3)
    sub = KeyMaskTable(CHUNK).sub_block
    largest = _largest_anchored_exponent(inputs["a"], sub)
    for scale, expected in ((0.95 * RANGE / largest, 1.0), (1.05 * RANGE / largest, 0.0)):
        got = _products("blocked", {**inputs, "a": inputs["a"] * scale}, interpret)
        assert got["in_range"][0, 0] == expected, f"scale {scale}"
        assert _largest_anchored_exponent(inputs["a"] * scale, CHUNK) > RANGE  # the chunk-wide anchor is not


def test_sub_anchor_block_is_the_signed_segment_sum_to_each_sub_block_middle():
    table = KeyMaskTable(CHUNK)
    rows = np.asarray(table.build(), np.float64)[table.sub_anchor * CHUNK : (table.sub_anchor + 1) * CHUNK]
    a = _inputs(1.0, seed=4)["a"][0]
    b = np.cumsum(a, axis=0)
    s = table.sub_block
    middles = (np.arange(CHUNK) // s) * s + s // 2 - 1
    np.testing.assert_allclose(rows @ a, b - b[middles], rtol=0, atol=1e-12)


def test_blocked_products_need_a_positive_range():
    with pytest.raises(InvalidArgumentError, match="anchor_range"):
        BlockedProducts(jnp.zeros((CHUNK, KEYS)), None, CHUNK, 0.0, jnp.float32)
