"""kda_gate (implementation `xla`) and l2norm against the float64 oracle."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
from gla_kda import fused_kda_gate
from gla_kda.l2norm import l2norm
from gla_ref import gates as ref_gates
from gla_ref.testing import TOLERANCES, assert_close, check_against_oracle, make_case

pytestmark = pytest.mark.oracle


@pytest.mark.parametrize("dt_bias", [True, False], ids=["dt_bias", "no_dt_bias"])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "lower_bound"])
def test_gate_matches_oracle(jitted, dt_bias, lower_bound):
    case = make_case("kda_gate", batch=2, seq_len=37, num_heads=3, key_dim=24, dt_bias=dt_bias, lower_bound=lower_bound)
    errors = check_against_oracle(jitted("xla", case), case)
    assert set(errors) == {"gate", "dg", "dA_log"} | ({"ddt_bias"} if dt_bias else set())


def test_gate_bfloat16_input(jitted):
    case = make_case("kda_gate", seq_len=64, num_heads=2, key_dim=32, dtype=jnp.bfloat16, lower_bound=-3.0)
    check_against_oracle(jitted("xla", case), case)


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "lower_bound"])
def test_gate_saturated_backward_matches_oracle(jitted, lower_bound):
    """g = 12 + randn, A_log = 0: the sigmoid saturates (z >~ 8), where s (1 - s) formed in float32
    loses its digits (dA_log was off by 2e-3); the gradients must keep float32 accuracy."""
    case = make_case("kda_gate", seq_len=64, num_heads=2, key_dim=32, dt_bias=False, lower_bound=lower_bound)
    rng = np.random.default_rng(1)
    inputs = dict(case.inputs, g=jnp.asarray(12.0 + rng.standard_normal(case.inputs["g"].shape), jnp.float32))
    inputs["A_log"] = jnp.zeros_like(case.inputs["A_log"])
    case = dataclasses.replace(case, inputs=inputs, label=case.label + " g=12+randn A_log=0")
    check_against_oracle(jitted("xla", case), case)


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "lower_bound"])
def test_gate_extreme_inputs_match_oracle(jitted, lower_bound):
    """Raw inputs from -1e30 to 1e30 and a large A_log: the gate and its gradients stay finite and exact."""
    case = make_case("kda_gate", batch=2, seq_len=8, num_heads=2, key_dim=16, lower_bound=lower_bound)
    g = np.linspace(-1e4, 1e4, case.inputs["g"].size).reshape(case.inputs["g"].shape)
    g[0, 0] = 1e30
    g[1, 1] = -1e30
    inputs = dict(case.inputs, g=jnp.asarray(g, jnp.float32), A_log=jnp.asarray([6.0, -2.0], jnp.float32))
    case = dataclasses.replace(case, inputs=inputs, label=case.label + " extremes")
    check_against_oracle(jitted("xla", case), case)


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "lower_bound"])
def test_gate_float64_computes_in_float64(lower_bound):
    """With x64 on, float64 inputs (and the default output_dtype): float64-exact (TOLERANCES["float64"])."""
    with jax.enable_x64(True):
        case = make_case("kda_gate", seq_len=20, num_heads=2, key_dim=16, lower_bound=lower_bound)
        inputs = {name: jnp.asarray(np.asarray(x), jnp.float64) for name, x in case.inputs.items()}
        case = dataclasses.replace(case, inputs=inputs, label=case.label.replace("float32", "float64"))
        fn = jax.jit(
            lambda **kw: gla_core.dispatch("kda_gate", impl="xla", **kw),  # default output_dtype: float64 here
            static_argnames="lower_bound",
        )
        check_against_oracle(fn, case)


@pytest.mark.parametrize("shape", [dict(batch=0, seq_len=20), dict(batch=2, seq_len=0)], ids=["B0", "T0"])
def test_gate_empty_inputs(jitted, shape):
    case = make_case("kda_gate", lower_bound=-5.0, **shape)
    check_against_oracle(jitted("xla", case), case)


def test_gate_output_dtype_and_large_inputs():
    """output_dtype is respected; extreme raw inputs give a finite gate and finite gradients."""
    g = jnp.asarray(np.linspace(-200.0, 200.0, 2 * 8 * 2 * 16).reshape(2, 8, 2, 16), jnp.float32)
    A_log = jnp.asarray([3.0, -2.0], jnp.float32)
    dt_bias = jnp.zeros((32,), jnp.float32)
    assert fused_kda_gate(g, A_log, dt_bias, output_dtype=jnp.bfloat16).dtype == jnp.bfloat16
    for lower_bound in (None, -5.0):
        gate, vjp = jax.vjp(functools.partial(fused_kda_gate, lower_bound=lower_bound), g, A_log, dt_bias)
        assert gate.dtype == jnp.float32
        assert bool(jnp.all(jnp.isfinite(gate))) and bool(jnp.all(gate <= 0))
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in vjp(jnp.ones_like(gate)))


def test_l2norm_matches_float64_reference():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 2, 40)).astype(np.float32)
    x[0, 0, 0] = 0.0  # an all-zero row: only eps keeps it finite
    ct = rng.standard_normal(x.shape)
    y, vjp = jax.vjp(l2norm, jnp.asarray(x))
    (dx,) = vjp(jnp.asarray(ct, jnp.float32))
    with jax.enable_x64(True):
        y_ref, vjp_ref = jax.vjp(ref_gates.l2norm, jnp.asarray(x, jnp.float64))
        (dx_ref,) = vjp_ref(jnp.asarray(ct))
    tol = TOLERANCES["float32"]
    assert_close("y", y, y_ref, tol.output)
    assert_close("dx", dx, dx_ref, tol.grad)


def test_registered():
    impls = {i.name: i for i in gla_core.implementations("kda_gate")}
    assert impls["xla"].priority == 50 and impls["xla"].backends == {"cpu", "gpu", "tpu"}
