"""`fused_g_gamma` without kernels: its registration, what it declines and why, which calls
dispatch gives it, and the analytic decays against a float64 computation from the per-step
log decays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
from gla_fused.g_gamma import decay, supports
from gla_ref.testing import TOLERANCES, relative_error

SHAPE = (2, 100, 4, 48)  # B, T, H, K (= V)


def _call(**overrides) -> gla_core.Call:
    fields = dict(
        op="simple_gla",
        batch=SHAPE[0],
        seq_len=SHAPE[1],
        num_heads=SHAPE[2],
        key_dim=SHAPE[3],
        value_dim=SHAPE[3],
        gates={"g_gamma"},
        backend="tpu",
    )
    return gla_core.Call(**{**fields, **overrides})


def _arrays(dtype=jnp.float32, gates=("g_gamma",)):
    b, t, h, _ = SHAPE
    qkv = [jax.ShapeDtypeStruct(SHAPE, dtype) for _ in range(3)]
    shapes = {"g": ((b, t, h), dtype), "g_gamma": ((h,), jnp.float32)}
    return qkv, {name: jax.ShapeDtypeStruct(*shapes[name]) for name in gates}


def _implementation() -> gla_core.Implementation:
    return next(i for i in gla_core.implementations("simple_gla") if i.name == "fused_g_gamma")


def test_registered_for_tpu_above_chunk():
    impl = _implementation()
    assert (impl.priority, impl.backends, impl.package, impl.interpretable) == (105, {"tpu"}, "gla-fused", True)


def test_accepts_g_gamma_only_fixed_length_calls():
    assert supports(_call()) is None
    assert supports(_call(dtype="bfloat16", has_initial_state=True, output_final_state=True)) is None


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (dict(gates={"g"}), "needs g_gamma as the only gate; this call has {'g'}: use fused_chunk or chunk"),
        (dict(gates={"g", "g_gamma"}), "this call has {'g', 'g_gamma'}"),
        (dict(gates=set()), "this call has no gate"),
        (dict(num_sequences=3, batch=1), "packed varlen input (cu_seqlens, 3 sequences)"),
        (dict(dtype="float64"), "float64 inputs"),
    ],
)
def test_declines_with_a_reason(overrides, expected):
    reason = supports(_call(**overrides))
    assert reason is not None and expected in reason


def test_dispatch_on_tpu_accepts_g_gamma_only_calls_below_fused_chunk():
    arrays, gates = _arrays()
    with gla_core.use(backend="tpu"):
        resolution = gla_core.explain("simple_gla", *arrays, **gates)
        assert resolution.winner.name == "fused_chunk"
        assert next(c for c in resolution.candidates if c.implementation.name == "fused_g_gamma").accepted
        assert gla_core.explain("simple_gla", *arrays, impl="fused_g_gamma", **gates).winner.name == "fused_g_gamma"
        arrays, gates = _arrays(gates=("g", "g_gamma"))
        resolution = gla_core.explain("simple_gla", *arrays, **gates)
    assert resolution.winner.name != "fused_g_gamma"
    declined = next(c for c in resolution.candidates if c.implementation.name == "fused_g_gamma")
    assert "needs g_gamma as the only gate" in declined.reason


def test_dispatch_on_cpu_keeps_xla_unless_interpreting():
    arrays, gates = _arrays()
    with gla_core.use(backend="cpu", interpret=False):
        assert gla_core.explain("simple_gla", *arrays, **gates).winner.name == "xla"
    with gla_core.use(backend="cpu", interpret=True):
        assert gla_core.explain("simple_gla", *arrays, **gates).winner.name == "fused_chunk"


def _reference_decays(gamma: float, valid: int, chunk: int) -> dict[str, np.ndarray]:
    """float64 decays of one chunk from its per-step log decays (gamma on valid steps, 0 on padding)."""
    a = np.where(np.arange(chunk) < valid, gamma, 0.0)
    b = np.cumsum(a)  # b_t = sum_{u<=t} a_u
    lag = b[:, None] - b[None, :]  # sum_{s<u<=t} a_u
    causal = np.tril(np.ones((chunk, chunk), bool))
    return {
        "from_start": np.exp(b)[:, None],
        "to_end": np.exp(b[-1] - b)[:, None],
        "last": np.exp(b[-1]).reshape(1, 1),
        "pairs": np.where(causal, np.exp(np.where(causal, lag, 0.0)), 0.0),
    }


@pytest.mark.parametrize(("gamma", "valid", "chunk"), [(-10.0, 128, 128), (-10.0, 72, 128), (-0.0625, 13, 16)])
def test_decays_match_float64_per_step_products(gamma, valid, chunk):
    chunk_decay = decay.ChunkDecay(jnp.float32(gamma), jnp.int32(valid), chunk)
    for name, expected in _reference_decays(gamma, valid, chunk).items():
        got = np.asarray(getattr(chunk_decay, name))
        assert np.isfinite(got).all(), name
        # elementwise: float32 exp is exact to a few ulps; values below float32's range flush to 0
        np.testing.assert_allclose(
            got, expected, rtol=TOLERANCES["float32_elementwise"].output, atol=1e-37, err_msg=name
        )


@pytest.mark.parametrize(("gamma", "valid", "chunk"), [(-0.5, 40, 64), (-0.0625, 13, 16)])
def test_pair_decay_tangent_matches_float64_finite_differences(gamma, valid, chunk):
    step = 1e-6
    plus = _reference_decays(gamma + step, valid, chunk)["pairs"]
    minus = _reference_decays(gamma - step, valid, chunk)["pairs"]
    got = decay.ChunkDecay(jnp.float32(gamma), jnp.int32(valid), chunk).pairs_tangent
    assert relative_error(got, (plus - minus) / (2 * step)) <= TOLERANCES["float32_building_block"].grad


def test_valid_steps_of_the_last_chunk():
    assert [int(decay.valid_steps(c, 64, 150)) for c in range(3)] == [64, 64, 22]
