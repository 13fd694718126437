"""The float64 chunked forms equal the recurrences: outputs, final states and every gradient."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from gla_ref import chunked, recurrent
from gla_ref.testing import TOLERANCES, make_case, relative_error

TOL = TOLERANCES["float64_identity"].output

# Boundaries off the chunk grid, with a zero-length (37..37) and a length-1 (37..38) sequence.
VARLEN = [0, 37, 37, 38, 150, 200]

CONFIGS = {
    "simple_gla-g+g_gamma-varlen": dict(op="simple_gla", gates=("g", "g_gamma"), seq_len=200, cu_seqlens=VARLEN),
    "simple_gla-g_gamma-batch": dict(op="simple_gla", gates=("g_gamma",), batch=2, seq_len=100),
    "gla-varlen": dict(op="gla", seq_len=200, cu_seqlens=VARLEN),
    "gla-strong-decay-batch": dict(op="gla", batch=2, seq_len=100, gate_scale=10.0),
    "kda-all-options-varlen": dict(
        op="kda",
        seq_len=200,
        cu_seqlens=VARLEN,
        num_value_heads=4,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        lower_bound=-5.0,
        use_beta_sigmoid_in_kernel=True,
    ),
    "kda-plain-batch": dict(op="kda", batch=2, seq_len=100),
}

CHUNK_SIZES = {
    "simple_gla-g+g_gamma-varlen": (64,),
    "gla-varlen": (16,),
    "kda-all-options-varlen": (16, 64),
}


def _cases():
    for name, config in CONFIGS.items():
        for chunk_size in CHUNK_SIZES.get(name, (32,)):
            yield pytest.param(config, chunk_size, id=f"{name}-C{chunk_size}")


@pytest.mark.parametrize(("config", "chunk_size"), list(_cases()))
def test_chunked_equals_recurrent(x64, float64_vjp, config, chunk_size):
    config = dict(config)
    op = config.pop("op")
    case = make_case(
        op, key_dim=16, value_dim=8, initial_state=True, output_final_state=True, chunk_size=chunk_size, **config
    )
    reference_out, reference_grads = float64_vjp(getattr(recurrent, op), case)
    out, grads = float64_vjp(getattr(chunked, op), case)
    assert set(out) == {"o", "final_state"} == set(reference_out)
    assert set(grads) == {"d" + n for n in case.differentiable}
    for name in reference_out:
        assert np.isfinite(out[name]).all(), name
        assert relative_error(out[name], reference_out[name]) <= TOL, name
    for name, reference in reference_grads.items():
        assert np.abs(reference).max() > 0, f"{name} of the recurrence is zero"
        assert relative_error(grads[name], reference) <= TOL, name


def test_chunked_without_state_arguments(x64):
    case = make_case("gla", seq_len=45, key_dim=8, value_dim=8)
    inputs = {n: jnp.asarray(np.asarray(x, np.float64)) for n, x in case.inputs.items()}
    o, final_state = chunked.gla(**inputs, chunk_size=16)
    reference, _ = recurrent.gla(**inputs)
    assert final_state is None
    assert o.dtype == jnp.float64
    assert relative_error(o, reference) <= TOL


def test_chunked_extreme_decay_stays_finite(x64):
    # |g| * chunk far beyond exp's range: every factor must come from a masked, non-positive exponent.
    case = make_case("kda", seq_len=128, key_dim=8, value_dim=8, gate_scale=40.0, initial_state=True)
    inputs = {n: jnp.asarray(np.asarray(x, np.float64)) for n, x in case.inputs.items()}
    assert float(jnp.min(inputs["g"]) * 128) < -1000
    o, final_state = chunked.kda(**inputs, output_final_state=True, chunk_size=128)
    reference, reference_state = recurrent.kda(**inputs, output_final_state=True)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(final_state)).all()
    assert relative_error(o, reference) <= TOL
    assert relative_error(final_state, reference_state) <= TOL


@pytest.mark.parametrize("module", [recurrent, chunked], ids=["recurrent", "chunked"])
def test_empty_packed_stream_keeps_initial_states(x64, module):
    case = make_case("kda", seq_len=0, key_dim=4, value_dim=4, initial_state=True, cu_seqlens=[0, 0, 0])
    inputs = {n: jnp.asarray(np.asarray(x, np.float64)) for n, x in case.inputs.items()}
    o, final_state = module.kda(**inputs, cu_seqlens=case.options["cu_seqlens"], output_final_state=True)
    assert o.shape == (1, 0, 2, 4)
    np.testing.assert_array_equal(np.asarray(final_state), np.asarray(inputs["initial_state"]))
