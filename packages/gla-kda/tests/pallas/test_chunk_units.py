"""Unit tests of the kda `chunk` building blocks (plain jnp on the CPU).

The in-kernel helpers of `gla_kda.pallas.chunk_math` are pure jnp functions, so they are
checked here directly against float64 numpy brute force (explicit [C, C, K] decay tensors,
np.linalg.inv), including decays strong enough that exp(G) underflows. Tolerance:
`TOLERANCES["float32_building_block"]` (float32 arithmetic on O(C) terms). The in-kernel
cumsum (`pltpu.roll`) runs in a Pallas call in TPU interpret mode. Also the XLA-side layout
helpers and the registration record.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import gla_core
from gla_kda.inputs import floor_log_decay
from gla_kda.nonfinite import zero_nonfinite
from gla_kda.pallas import chunk_math as cm
from gla_kda.pallas import layout as kl
from gla_kda.pallas.config import BlockSizes
from gla_kda.pallas.gated_grads import diagonals_in_range, gated_grads
from gla_ref.testing import TOLERANCES, assert_close

TOL = TOLERANCES["float32_building_block"].output
BF16X3_TOL = TOLERANCES["bfloat16x3_product"].output
BF16_OPERAND_TOL = TOLERANCES["bfloat16"].output
BF16X3_INVERSE_TOL = TOLERANCES["bfloat16x3_inverse"].output
C, S, K = 64, 16, 32


def _chunk_data(seed: int, decay_scale: float):
    rng = np.random.default_rng(seed)
    g = -decay_scale * rng.uniform(0.0, 1.0, size=(C, K))
    a, b = rng.standard_normal((C, K)), rng.standard_normal((C, K))
    return g, a, b


def _strong_then_weak(seed: int):
    """Strong decays (-18 to -20) on the first 12 steps of every sub-block, weak ones (> -0.05)
    after them.

    The pairs of weak steps sit behind a cumsum of about -230: their decays exp(L_i - L_j) are
    of order 1 while a rounded cumsum holds L only to eps * 230 = 3e-5.
    """
    g, a, b = _chunk_data(seed, 0.05)
    strong = (np.arange(C) % S) < 12
    g[strong] = -np.random.default_rng(seed + 10).uniform(18.0, 20.0, size=g[strong].shape)
    return g, a, b


def _local(g):
    """(hi, lo) float32 [C, K]: the compensated sub-block-local cumsum the kernels form
    (`chunk_math.Decays.of_steps`, in a Pallas kernel in TPU interpret mode)."""

    def kernel(g_ref, hi_ref, lo_ref):
        decays = cm.Decays.of_steps(g_ref[...], cm.SubBlocks(C, S))
        hi_ref[...], lo_ref[...] = decays.hi, decays.lo

    out = jax.ShapeDtypeStruct((C, K), jnp.float32)
    return pl.pallas_call(kernel, out_shape=[out, out], interpret=pltpu.InterpretParams())(jnp.asarray(g, jnp.float32))


def _decay_tensor(g):
    """[C, C, K] exp(G_i - G_j) for j <= i (0 above), float64."""
    cum = np.cumsum(g, axis=0)
    diff = cum[:, None, :] - cum[None, :, :]
    causal = np.tril(np.ones((C, C), bool))[:, :, None]
    return np.where(causal, np.exp(np.where(causal, diff, 0.0)), 0.0)


@jax.jit
def _exponents(hi, lo):
    d = cm.Decays(hi, cm.SubBlocks(C, S), lo)
    return d.cum, d.to_end, d.total, d.before_anchor(2), d.within_block(2), d.from_position(5)


@functools.partial(jax.jit, static_argnames=("unroll", "dtype", "anchor_range"))
def _products(hi, lo, a, b, p, unroll, dtype=jnp.float32, anchor_range=None):
    """(rows, cols, dg, in range) as the backward kernel forms them: with the diagonal sub-blocks
    anchored when `anchor_range` is given and the chunk is within it, exact otherwise."""
    d = cm.Decays(hi, cm.SubBlocks(C, S), lo)

    def products(anchor):
        grads = gated_grads([(p, a)], b, d, dtype, unroll, anchor)
        zeros = jnp.zeros_like(a)
        dg = d.gate_grad(zeros, zeros, grads.after_block, grads.before_block, dtype) + grads.direct
        return grads.rows[0], grads.cols[0], dg

    if anchor_range is None:
        return *products(None), jnp.asarray(False)
    in_range = diagonals_in_range(d, anchor_range)
    anchored, exact = products(anchor_range), products(None)
    return *(jnp.where(in_range, x, y) for x, y in zip(anchored, exact, strict=True)), in_range


def _exponent_pairs(g):
    """(name, computed, float64 reference, kept rows) of every exponent kind of `Decays`."""
    cum = np.cumsum(g, axis=0)
    rows = np.arange(C)
    anchor = (rows // S) * S + 5
    got = _exponents(*_local(g))
    every = np.ones(C, bool)
    return [
        ("cum", got[0], cum, every),
        ("to_end", got[1], cum[-1] - cum, every),
        ("total", got[2], cum[-1:], np.ones(1, bool)),
        ("before_anchor", got[3], np.where(rows[:, None] < 2 * S, cum[2 * S] - cum, 0.0), rows < 2 * S),
        ("within_block", got[4], cum[2 * S : 3 * S] - cum[2 * S], np.ones(S, bool)),
        ("from_position", got[5], np.where((rows % S >= 5)[:, None], cum - cum[anchor], 0.0), rows % S >= 5),
    ]


@pytest.mark.parametrize("data", ["mild", "strong", "strong_then_weak"])
def test_decay_exponents_match_cumsum(data):
    g, _, _ = {"mild": _chunk_data(0, 0.5), "strong": _chunk_data(0, 40.0), "strong_then_weak": _strong_then_weak(0)}[
        data
    ]
    for name, x, ref, kept in _exponent_pairs(g):
        assert_close(name, jnp.where(jnp.asarray(kept)[:, None], x, 0.0), np.where(kept[:, None], ref, 0.0), TOL)


def test_decays_stay_exact_behind_strong_decays():
    """Every decay exp(exponent) of order 1 keeps float32 accuracy per element, also for the weak
    steps that follow strong ones in a sub-block (a difference of rounded cumsums would be off
    by eps * |L| = 3e-5 there)."""
    g, _, _ = _strong_then_weak(4)
    for name, x, ref, kept in _exponent_pairs(g):
        visible = np.broadcast_to(kept[:, None] & (ref > -1.0), ref.shape)  # decays of order 1
        decay, expected = np.exp(np.asarray(x, np.float64)[visible]), np.exp(ref[visible])
        error = float(np.max(np.abs(decay - expected) / expected, initial=0.0))
        assert error <= TOLERANCES["float32_elementwise"].output, f"{name}: decay off by {error:.2e} relative"


def _gated_product_reference(g, a, b, weights):
    """(rows, cols, dg) of the gated products in float64: explicit [C, C, K] decays."""
    decay = _decay_tensor(g)
    pairs = np.einsum("ij,id,jd,ijd->ijd", weights, a, b, decay)
    # d/dg_u of sum_ij W_ij a_i b_j exp(G_i - G_j): the pairs j < u <= i.
    dg = np.stack([pairs[u:, :u].sum(axis=(0, 1)) for u in range(C)])
    return np.einsum("ij,jd,ijd->id", weights, b, decay), np.einsum("ij,id,ijd->jd", weights, a, decay), dg


def _gated_product_data(data: str):
    g, a, b = {"mild": _chunk_data(1, 0.5), "strong": _chunk_data(1, 40.0), "strong_then_weak": _strong_then_weak(1)}[
        data
    ]
    return g, a, b, np.tril(np.random.default_rng(2).standard_normal((C, C)))


@pytest.mark.parametrize(
    ("data", "unroll", "anchor_range"),
    [
        ("mild", False, None),
        ("mild", True, 8.0),  # every |D| <= 4: the anchored diagonal sub-blocks
        ("strong", False, None),
        ("strong", True, None),
        ("strong", True, 8.0),  # out of the anchor range: the exact loop
        ("strong_then_weak", False, None),
        ("strong_then_weak", True, 8.0),
    ],
)
def test_gated_product_gradients(data, unroll, anchor_range):
    """gated_grads (row, column and per-step decay gradients of the gated products) against explicit
    [C, C, K] decays, rolled (interpret mode) and unrolled with static row picks (TPU), with the
    diagonal sub-blocks exact or anchored. The forward's gated products are gla-core's
    (`gla_core.chunk.products`, tested there)."""
    g, a, b, weights = _gated_product_data(data)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    *got, anchored = _products(*_local(g), f32(a), f32(b), f32(weights), unroll, anchor_range=anchor_range)
    assert bool(anchored) == (anchor_range is not None and data == "mild")
    for name, value, expected in zip(
        ("rows", "cols", "dg"), got, _gated_product_reference(g, a, b, weights), strict=True
    ):
        assert_close(name, value, expected, TOL)


def test_anchored_gated_product_gradients_in_bfloat16():
    """bfloat16 matrix-unit operands, the anchored diagonal sub-blocks against the exact loop and
    float64: the gate gradient's row and column sums cancel on the same rounded terms, so it keeps
    bfloat16 operand accuracy (a difference of separately rounded sums would be off by s * 2^-9)."""
    g, a, b, weights = _gated_product_data("mild")
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    reference = _gated_product_reference(g, a, b, weights)
    products = functools.partial(_products, *_local(g), f32(a), f32(b), f32(weights), True, jnp.bfloat16)
    for anchor_range in (None, 30.0):
        *got, anchored = products(anchor_range=anchor_range)
        assert bool(anchored) == (anchor_range is not None)
        for name, value, expected in zip(("rows", "cols", "dg"), got, reference, strict=True):
            assert_close(f"{name} (anchor range {anchor_range})", value, expected, BF16_OPERAND_TOL)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gate_grad_sums_each_term_over_its_steps(dtype):
    """Float32 sums whatever the inputs' dtype (bfloat16: both bfloat16 parts of each term)."""
    rng = np.random.default_rng(6)
    parts = [rng.standard_normal((C, K)) for _ in range(4)]
    d = cm.Decays(jnp.zeros((C, K), jnp.float32), cm.SubBlocks(C, S), jnp.zeros((C, K), jnp.float32))
    got = jax.jit(functools.partial(d.gate_grad, dtype=dtype))(*(jnp.asarray(x, jnp.float32) for x in parts))
    rows, block = np.arange(C), np.arange(C) // S
    masks = (
        rows[None, :] >= rows[:, None],
        rows[None, :] < rows[:, None],
        (rows[None, :] >= rows[:, None]) & (block[None, :] == block[:, None]),
        (rows[None, :] < rows[:, None]) & (block[None, :] == block[:, None]),
    )
    expected = sum(mask.astype(float) @ x for mask, x in zip(masks, parts, strict=True))
    assert_close("dg", got, expected, TOL if dtype == jnp.float32 else BF16X3_TOL)


def test_local_cumsum_is_compensated_and_cleans_its_input():
    """hi + lo is the float64 sub-block cumsum (hi alone is off by up to half an ulp of |L| ~ 300,
    ~1e-5 absolute), and the scan cleans its input: -inf and floors to the float32 floor, NaN and
    +inf to 0."""
    g, _, _ = _strong_then_weak(3)
    g = np.asarray(g, np.float32)
    g[3, 0], g[20, 1], g[40, 2], g[50, 3] = -np.inf, np.nan, np.inf, -1e30
    hi, lo = _local(g)
    clean = np.where(np.isfinite(g), np.maximum(g, cm.LOG_DECAY_FLOOR), 0.0).astype(np.float32)
    clean[3, 0] = cm.LOG_DECAY_FLOOR
    exact = np.cumsum(clean.astype(np.float64).reshape(C // S, S, K), axis=1).reshape(C, K)
    assert_close(
        "hi + lo", np.asarray(hi, np.float64) + np.asarray(lo, np.float64), exact, TOLERANCES["float64_identity"].output
    )


def _uncompensated_decays(g):
    """(exp(G), exp(G_last - G)) [C, K] as the state kernels form them from an uncompensated
    cumsum (`KernelConfig.compensated_decays` False), in a Pallas call in TPU interpret mode."""

    def kernel(g_ref, decay_ref, to_end_ref):
        decays = cm.Decays.of_steps(g_ref[...], cm.SubBlocks(C, S), compensated=False)
        decay_ref[...], to_end_ref[...] = jnp.exp(decays.cum), jnp.exp(decays.to_end)

    out = jax.ShapeDtypeStruct((C, K), jnp.float32)
    return pl.pallas_call(kernel, out_shape=[out, out], interpret=pltpu.InterpretParams())(jnp.asarray(g, jnp.float32))


@pytest.mark.parametrize("strong_steps", [8, 12])
def test_uncompensated_decays_err_below_bfloat16_rounding(strong_steps):
    """Without the compensation, exp(G) and exp(G_last - G) stay within `uncompensated_decays` of
    float64, worst where a sub-block's first steps sit near the floor and the rest are weak (a
    cumsum of about -800 behind decays of order 1)."""
    rng = np.random.default_rng(strong_steps)
    g = -rng.uniform(0.0, 0.05, size=(C, K))
    strong = (np.arange(C) % S) < strong_steps
    g[strong] = rng.uniform(cm.LOG_DECAY_FLOOR, cm.LOG_DECAY_FLOOR + 4.0, size=g[strong].shape)
    g = g.astype(np.float32).astype(np.float64)
    cum = np.cumsum(g, axis=0)
    decay, to_end = _uncompensated_decays(g)
    bound = TOLERANCES["uncompensated_decays"].output
    assert_close("exp(G)", decay, np.exp(cum), bound)
    assert_close("exp(G_last - G)", to_end, np.exp(cum[-1:] - cum), bound)


def test_clean_log_decay_grad_is_the_vjp_of_the_cleaning():
    """The backward kernel's gradient through the cleaning of g is JAX's own VJP of the XLA cleaning
    (floor, then non-finite entries zeroed with the gradient passed through)."""
    floor = cm.LOG_DECAY_FLOOR
    g = jnp.asarray([-np.inf, -1e30, floor * 2, floor, floor / 2, -0.5, 0.0, np.nan, np.inf], jnp.float32)
    dg = jnp.arange(1.0, g.size + 1.0, dtype=jnp.float32)
    _, vjp = jax.vjp(lambda x: zero_nonfinite(floor_log_decay(x)), g)
    np.testing.assert_array_equal(cm.clean_log_decay_grad(g, dg), vjp(dg)[0])


@pytest.mark.parametrize("unroll", [False, True])
def test_unit_lower_inverse(unroll):
    rng = np.random.default_rng(3)
    a = np.tril(rng.uniform(-0.5, 0.5, size=(C, C)), -1)
    inverse = jax.jit(lambda x: cm.unit_lower_inverse(x, cm.SubBlocks(C, S), unroll))(jnp.asarray(a, jnp.float32))
    assert_close("(I + A)^-1", inverse, np.linalg.inv(np.eye(C) + a), TOL)


@pytest.mark.parametrize("block", [8, S])
@pytest.mark.parametrize("unroll", [False, True])
def test_unit_lower_inverses_bf16_path(unroll, block):
    """The bfloat16-input path solves with `dot_bf16x3`: each matrix as its own inverse, to ~2^-16."""
    rng = np.random.default_rng(4)
    mats = [np.tril(rng.uniform(-0.5, 0.5, size=(C, C)), -1) for _ in range(3)]
    solve = jax.jit(lambda xs: cm.unit_lower_inverses(xs, cm.SubBlocks(C, block), unroll, jnp.bfloat16))
    for a, inverse in zip(mats, solve([jnp.asarray(a, jnp.float32) for a in mats]), strict=True):
        assert_close("(I + A)^-1 (bf16x3)", inverse, np.linalg.inv(np.eye(C) + a), BF16X3_TOL)


@pytest.mark.parametrize("block", [8, S])
@pytest.mark.parametrize("chunk", [16, 32, 48, 64, 128])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unit_lower_inverse_of_kda_like_matrices(chunk, dtype, block):
    """Akk as kda forms it (unit keys, beta 1, no decay), keys from nearly parallel to independent:
    diagonal blocks of 8 rows (the forward's, `BlockSizes.inverse_block`) or 16, 1 to 16 of them
    (0 to 4 levels of joined blocks)."""
    rng = np.random.default_rng(chunk)
    tol = TOL if dtype == jnp.float32 else BF16X3_INVERSE_TOL
    solve = jax.jit(lambda xs: cm.unit_lower_inverses(xs, cm.SubBlocks(chunk, block), True, dtype))
    mats = []
    for correlation in (0.0, 0.9, 0.99):
        keys = correlation * rng.standard_normal(128) + (1 - correlation) * rng.standard_normal((chunk, 128))
        keys /= np.linalg.norm(keys, axis=1, keepdims=True)
        mats.append(np.tril(keys @ keys.T, -1))
    for a, inverse in zip(mats, solve([jnp.asarray(a, jnp.float32) for a in mats]), strict=True):
        assert_close("(I + Akk)^-1", inverse, np.linalg.inv(np.eye(chunk) + a), tol)


def test_select_exact_copies_float32_bits():
    """A 0/1 selection product on the matrix unit copies float32 values bit for bit (three
    bfloat16 parts), across magnitudes from 1e-30 to 1e30 and both signs."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((32, C)) * 10.0 ** rng.integers(-30, 30, size=(32, C))
    x = jnp.asarray(x, jnp.float32)
    target = rng.permutation(C)
    selection = np.zeros((C, C), bool)
    selection[np.arange(C), target] = True  # output column target[j] copies column j
    copied = jax.jit(cm.select_exact)(x, jnp.asarray(selection))
    np.testing.assert_array_equal(np.asarray(copied)[:, target], np.asarray(x))


@pytest.mark.parametrize("chunk", [16, 48, 128])
def test_packed_blocks_round_trip(chunk):
    """pack keeps exactly the s x s diagonal blocks; unpack puts them back with zeros elsewhere."""
    sb = cm.SubBlocks(chunk, S)
    a = np.random.default_rng(chunk).standard_normal((chunk, chunk)).astype(np.float32)
    blocks = cm.PackedBlocks(sb)
    round_trip = jax.jit(lambda x: blocks.unpack(blocks.pack(x)))(jnp.asarray(a))
    same_block = (np.arange(chunk)[:, None] // S) == (np.arange(chunk)[None, :] // S)
    np.testing.assert_array_equal(np.asarray(round_trip), np.where(same_block, a, 0.0))


@pytest.mark.parametrize(("trans_a", "trans_b"), [(False, False), (True, False), (False, True)])
def test_dot_bf16x3(trans_a, trans_b):
    """Three bfloat16 passes give a float32 product to ~2^-16 of max|ref| (one bfloat16 pass: ~2^-9)."""
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((C, 2 * C)), rng.standard_normal((2 * C, C))
    a_in, b_in = (a.T if trans_a else a), (b.T if trans_b else b)
    product = cm.dot_bf16x3(
        jnp.asarray(a_in, jnp.float32), jnp.asarray(b_in, jnp.float32), trans_a=trans_a, trans_b=trans_b
    )
    assert_close("a @ b (bf16x3)", product, a @ b, BF16X3_TOL)


@pytest.mark.parametrize(("num_chunks", "expected"), [(1, 1), (6, 6), (8, 8), (12, 6), (64, 8), (13, 1)])
def test_chunks_per_step(num_chunks, expected):
    assert BlockSizes(chunk_size=64, chunks_per_step=8).per_step(num_chunks) == expected


@pytest.mark.parametrize("cu_seqlens", [None, [0, 5, 5, 70, 90]])
def test_kernel_layout_round_trip(cu_seqlens):
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((1, 90, 3, 20)), jnp.float32)
    cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32)
    layout = kl.make_layout(90, 20, 20, 32, cu)
    tokens = kl.to_tokens(x, layout, layout.key_pad)
    assert tokens.shape == (1, layout.padded_len, 3 * 128)
    np.testing.assert_array_equal(kl.from_tokens(tokens, layout, 3, 20), x)
    meta = kl.chunk_meta(layout, 1)
    assert meta.first.shape == meta.last.shape == meta.seq.shape == (layout.num_chunks,)


def test_registration_and_explain_on_cpu():
    (impl,) = [i for i in gla_core.implementations("kda") if i.name == "chunk"]
    assert (impl.op, impl.name, impl.package, impl.priority, impl.backends, impl.interpretable) == (
        "kda",
        "chunk",
        "gla-kda",
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
