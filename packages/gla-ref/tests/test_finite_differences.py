"""Gradients of the recurrences (the oracle) agree with central finite differences in float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_ref import recurrent
from gla_ref.testing import TOLERANCES, make_case

STEP = 1e-5  # the step TOLERANCES["finite_differences"] is stated for
TOL = TOLERANCES["finite_differences"].grad

TINY = dict(seq_len=7, num_heads=1, key_dim=3, value_dim=2, initial_state=True, output_final_state=True)
VARLEN = dict(cu_seqlens=[0, 3, 3, 7])

CONFIGS = {
    "simple_gla-g+g_gamma-varlen": dict(op="simple_gla", gates=("g", "g_gamma"), **TINY, **VARLEN),
    "gla-varlen": dict(op="gla", **TINY, **VARLEN),
    "kda-plain": dict(op="kda", batch=2, **TINY),
    "kda-all-options-varlen": dict(
        op="kda",
        num_value_heads=2,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        lower_bound=-4.0,
        use_beta_sigmoid_in_kernel=True,
        **TINY,
        **VARLEN,
    ),
    "kda-gate-in-kernel-no-dt_bias": dict(op="kda", use_gate_in_kernel=True, dt_bias=False, **TINY),
    "kda_gate": dict(op="kda_gate", seq_len=3, num_heads=2, key_dim=3),
    "kda_gate-no-dt_bias": dict(op="kda_gate", seq_len=3, num_heads=2, key_dim=3, dt_bias=False),
    "kda_gate-lower_bound": dict(op="kda_gate", seq_len=3, num_heads=2, key_dim=3, lower_bound=-3.0),
    "kda_gate-lower_bound-no-dt_bias": dict(
        op="kda_gate", seq_len=3, num_heads=2, key_dim=3, lower_bound=-3.0, dt_bias=False
    ),
}


def _loss(case, names, values):
    """Jitted scalar `sum over outputs of <output, fixed random weights>` of the named inputs."""
    fn = getattr(recurrent, case.op)
    options = {n: v for n, v in case.options.items() if n != "chunk_size"}

    def outputs(*arrays):
        result = fn(**dict(zip(names, arrays, strict=True)), **options)
        return [result] if case.op == "kda_gate" else [x for x in result if x is not None]

    rng = np.random.default_rng(1)
    weights = [jnp.asarray(rng.standard_normal(s.shape)) for s in jax.eval_shape(outputs, *values)]
    return jax.jit(lambda *arrays: sum(jnp.sum(x * w) for x, w in zip(outputs(*arrays), weights, strict=True)))


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_gradients_match_central_differences(x64, config):
    config = dict(config)
    case = make_case(config.pop("op"), **config)
    names = case.differentiable
    values = [jnp.asarray(np.asarray(case.inputs[n], np.float64)) for n in names]
    loss = _loss(case, names, values)
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(names)))))(*values)
    rng = np.random.default_rng(2)
    for index, name in enumerate(names):
        direction = jnp.asarray(rng.standard_normal(values[index].shape))
        shifted = lambda sign, i=index, d=direction: loss(*values[:i], values[i] + sign * STEP * d, *values[i + 1 :])
        numeric = float(shifted(1.0) - shifted(-1.0)) / (2 * STEP)
        analytic = float(jnp.sum(grads[index] * direction))
        assert analytic != 0.0, f"d{name} is zero"
        assert abs(numeric - analytic) <= TOL * max(1.0, abs(analytic)), f"d{name}: {analytic} vs {numeric}"
