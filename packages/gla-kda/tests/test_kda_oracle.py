"""kda implementations `xla` and `recurrent` against the float64 oracle (outputs and every gradient).

Tolerances: `gla_ref.testing.TOLERANCES` (float32: 1e-5 outputs / final state, 1e-4 gradients;
bfloat16: the looser bounds stated there with their reasons).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_ref.testing import check_against_oracle, make_case

pytestmark = pytest.mark.oracle

# One case exercises several options at once to keep the number of compilations low.
CASES = {
    "h0_ht_T512_chunk128_grouped_x4": dict(
        seq_len=512,
        num_heads=1,
        num_value_heads=4,
        chunk_size=128,
        initial_state=True,
        output_final_state=True,
    ),
    "odd_dims_T97_chunk32": dict(
        seq_len=97, key_dim=40, value_dim=24, chunk_size=32, initial_state=True, output_final_state=True
    ),
    "l2norm_beta_sigmoid_chunk16": dict(
        seq_len=200,
        chunk_size=16,
        use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        output_final_state=True,
    ),
    "gate_lower_bound_no_dt_bias": dict(seq_len=150, use_gate_in_kernel=True, dt_bias=False, lower_bound=-5.0),
    "grouped_x2_all_options": dict(
        seq_len=130,
        num_heads=2,
        num_value_heads=4,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        lower_bound=-3.0,
        use_beta_sigmoid_in_kernel=True,
        initial_state=True,
        output_final_state=True,
    ),
    "varlen_unaligned_len1_len0": dict(
        seq_len=200, cu_seqlens=[0, 1, 1, 70, 77, 200], initial_state=True, output_final_state=True
    ),
    "varlen_grouped_gate_trailing_empty": dict(
        seq_len=100,
        cu_seqlens=[0, 33, 33, 100, 100],
        num_heads=2,
        num_value_heads=4,
        use_gate_in_kernel=True,
        use_qk_l2norm_in_kernel=True,
        initial_state=True,
        output_final_state=True,
        chunk_size=32,
    ),
}

XLA_CASES = tuple(name for name in sorted(CASES) if name != "gate_lower_bound_no_dt_bias")
# gate_lower_bound_no_dt_bias runs only through `recurrent` to save a compilation: the gate
# path (`gla_kda.inputs`) is shared, and kda_gate is tested on its own in test_gate.py.
RECURRENT_CASES = (
    "gate_lower_bound_no_dt_bias",
    "h0_ht_T512_chunk128_grouped_x4",
    "odd_dims_T97_chunk32",
    "grouped_x2_all_options",
    "varlen_unaligned_len1_len0",
    "varlen_grouped_gate_trailing_empty",
)


@pytest.mark.parametrize("name", XLA_CASES)
def test_xla_matches_oracle(jitted, name):
    case = make_case("kda", **CASES[name])
    check_against_oracle(jitted("xla", case), case)


@pytest.mark.parametrize("name", RECURRENT_CASES)
def test_recurrent_matches_oracle(jitted, name):
    case = make_case("kda", **CASES[name])
    check_against_oracle(jitted("recurrent", case), case)


@pytest.mark.parametrize("impl", ["xla", "recurrent"])
def test_bfloat16(jitted, impl):
    case = make_case(
        "kda",
        seq_len=128,
        dtype=jax.numpy.bfloat16,
        num_heads=2,
        num_value_heads=4,
        use_gate_in_kernel=True,
        use_qk_l2norm_in_kernel=True,
        initial_state=True,
        output_final_state=True,
    )
    check_against_oracle(jitted(impl, case), case)


def test_recurrent_decode_single_step(jitted):
    """T = 1 with a carried state: the decode path (xla's T = 1 is covered by length-1 varlen sequences)."""
    case = make_case("kda", batch=3, seq_len=1, initial_state=True, output_final_state=True, seed=2)
    check_against_oracle(jitted("recurrent", case), case)


def test_xla_extreme_decays_finite(jitted):
    """Per-step log decays down to about -150 with chunk 128 (|g| * chunk >> 88): finite and exact."""
    case = make_case(
        "kda", seq_len=256, chunk_size=128, gate_scale=30.0, initial_state=True, output_final_state=True, seed=3
    )
    assert float(np.min(np.asarray(case.inputs["g"]))) < -100.0
    errors = check_against_oracle(jitted("xla", case), case)
    assert all(np.isfinite(e) for e in errors.values())


def test_xla_extreme_in_kernel_gate_finite(jitted):
    """In-kernel gate (softplus, no dt_bias) with a large A_log: decays down to about -1e3 per step."""
    case = make_case(
        "kda",
        seq_len=200,
        use_gate_in_kernel=True,
        dt_bias=False,
        gate_scale=200.0,
        initial_state=True,
        output_final_state=True,
    )
    check_against_oracle(jitted("xla", case), case)


# --------------------------------------------------------------------------- edges of the float range

IMPLS = ("xla", "recurrent")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["grouped_h0_ht", "varlen"])
def test_hard_resets_match_oracle(jitted, hard_reset_case, impl, name):
    """Gates of -inf (decay exactly 0; its gradient is 0), -1e30, -1e4 and runs of -300: finite
    and equal to the oracle, at chunk, sub-chunk and sequence boundaries, with h0/ht."""
    case = hard_reset_case(name)
    check_against_oracle(jitted(impl, case), case)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "lower_bound"])
def test_in_kernel_gate_extremes_match_oracle(jitted, gate_extremes_case, impl, lower_bound):
    case = gate_extremes_case(lower_bound)
    check_against_oracle(jitted(impl, case), case)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["batch_heads_gate", "varlen_grouped", "varlen_mid_sequence_h0"])
def test_nonfinite_inputs_reach_only_later_outputs(jitted, nonfinite_case, nonfinite_check, impl, name):
    """A NaN/Inf in q, k, v, g, beta or h0 at step t reaches the outputs from t on that the
    recurrence lets it reach, and nothing in other sequences, batch rows or heads."""
    case, clean = nonfinite_case(name)
    nonfinite_check(jitted(impl, case), case, clean)


def _as_float64(case):
    """The case with every input in float64 (x64 must be on)."""
    inputs = {name: jnp.asarray(np.asarray(x), jnp.float64) for name, x in case.inputs.items()}
    return dataclasses.replace(case, inputs=inputs, label=case.label.replace("float32", "float64"))


@pytest.mark.parametrize("impl", IMPLS)
def test_float64_computes_in_float64(jitted, impl):
    """With x64 on and float64 inputs, the result is float64-exact (TOLERANCES["float64"])."""
    options = dict(
        seq_len=70,
        cu_seqlens=[0, 21, 21, 70],
        num_heads=1,
        num_value_heads=2,
        chunk_size=16,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        lower_bound=-5.0,
        use_beta_sigmoid_in_kernel=True,
        initial_state=True,
        output_final_state=True,
    )
    with jax.enable_x64(True):
        case = _as_float64(make_case("kda", **options))
        check_against_oracle(jitted(impl, case), case)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "shape",
    [dict(batch=0, seq_len=20), dict(batch=2, seq_len=0), dict(seq_len=0, cu_seqlens=[0, 0, 0])],
    ids=["B0", "T0", "varlen_all_empty"],
)
def test_empty_inputs(jitted, impl, shape):
    """No tokens: empty outputs, final state = initial state, gradients of the right shapes."""
    case = make_case(
        "kda",
        num_heads=1,
        num_value_heads=2,
        use_gate_in_kernel=True,
        initial_state=True,
        output_final_state=True,
        **shape,
    )
    check_against_oracle(jitted(impl, case), case)
