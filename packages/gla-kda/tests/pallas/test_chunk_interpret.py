"""kda implementation `chunk` (Pallas TPU kernels in TPU interpret mode) against the float64 oracle.

Each case runs `dispatch("kda", impl="chunk", interpret=interpret)` (True off TPU) forward and backward and
compares o, the final state and every gradient (q, k, v, g or raw g with A_log and dt_bias,
beta, initial_state) with `gla_ref.testing.check_against_oracle`. Tolerances are
`gla_ref.testing.TOLERANCES` (float32: 1e-5 outputs and final state, 1e-4 gradients;
bfloat16: the looser bounds stated there with their reasons). Shapes stay small (T <= 256,
K, V <= 64, H <= 2) and each case combines several options to keep compilations few; K and V
are never multiples of 128, so the lane padding is always exercised.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import gla_core
from gla_ref.testing import (
    TOLERANCES,
    assert_close,
    check_against_oracle,
    cotangents,
    make_case,
    oracle,
    relative_error,
)

pytestmark = pytest.mark.interpret

CASES = {
    "h0_ht_T100_odd_dims": dict(seq_len=100, key_dim=48, value_dim=40, initial_state=True, output_final_state=True),
    "batch2_h0_ht_chunk32": dict(batch=2, seq_len=80, chunk_size=32, initial_state=True, output_final_state=True),
    "grouped_x2_l2norm_chunk16": dict(
        seq_len=72,
        num_heads=1,
        num_value_heads=2,
        use_qk_l2norm_in_kernel=True,
        chunk_size=16,
        initial_state=True,
        output_final_state=True,
    ),
    "gate_dt_bias_beta_sigmoid": dict(
        seq_len=96, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, initial_state=True
    ),
    "gate_lower_bound_no_dt_bias_l2norm": dict(
        seq_len=64, use_gate_in_kernel=True, dt_bias=False, lower_bound=-5.0, use_qk_l2norm_in_kernel=True
    ),
    # |g| * chunk is far above 88 (per-step decays down to -150): exp(G) underflows inside a
    # chunk; nothing may overflow, and dh0 still matches.
    "extreme_decay_chunk128_h0_ht": dict(
        seq_len=128, chunk_size=128, gate_scale=30.0, initial_state=True, output_final_state=True
    ),
    "varlen_leading_trailing_empty_gate": dict(
        seq_len=90,
        cu_seqlens=[0, 0, 37, 90, 90],
        chunk_size=32,
        use_gate_in_kernel=True,
        use_qk_l2norm_in_kernel=True,
        initial_state=True,
        output_final_state=True,
    ),
    "bf16_h0_ht": dict(seq_len=128, dtype=jnp.bfloat16, initial_state=True, output_final_state=True),
}


def _report(case, errors) -> str:
    """One line with the measured relative errors (shown with `pytest -s`)."""
    return f"{case.label}: " + ", ".join(f"{name} {error:.1e}" for name, error in errors.items())


@pytest.mark.parametrize("name", list(CASES))
def test_chunk_matches_oracle(name, chunk_runner):
    case = make_case("kda", **CASES[name])
    errors = check_against_oracle(chunk_runner(case), case)
    print(_report(case, errors))
    assert set(errors) >= {"o", "dq", "dk", "dv", "dg", "dbeta"}


def test_varlen_grouped_new_boundaries_reuse_the_training_step(interpret):
    """Varlen with unaligned boundaries, a length-1 and a length-0 sequence, grouped value heads.

    One jitted forward + VJP step with traced `cu_seqlens` runs two boundary sets of the same N
    and T: it compiles once, and both results match the float64 oracle (same cotangents).
    """
    options = dict(seq_len=150, num_heads=1, num_value_heads=2, initial_state=True, output_final_state=True)
    cases = [
        make_case("kda", cu_seqlens=[0, 1, 1, 67, 150], **options),
        make_case("kda", cu_seqlens=[0, 64, 64, 149, 150], seed=1, **options),
    ]
    static = {n: v for n, v in cases[0].options.items() if n != "cu_seqlens"}

    @jax.jit
    def step(inputs, cu_seqlens, cts):
        run = lambda inputs: gla_core.dispatch(
            "kda", impl="chunk", interpret=interpret, cu_seqlens=cu_seqlens, **inputs, **static
        )
        outputs, vjp = jax.vjp(run, inputs)
        return outputs, vjp(cts)[0]

    tol = TOLERANCES["float32"]
    for case in cases:
        reference = oracle(case)
        shapes = {name: value.shape for name, value in reference.outputs.items()}
        cts = {name: jnp.asarray(ct, jnp.float32) for name, ct in cotangents(case, shapes, 0).items()}
        (o, ht), grads = step(case.inputs, case.options["cu_seqlens"], (cts["o"], cts["final_state"]))
        errors = {"o": (o, tol.output), "final_state": (ht, tol.output)}
        errors.update({"d" + name: (grads[name], tol.grad) for name in case.differentiable})
        for name, (value, bound) in errors.items():
            expected = reference.outputs[name] if name in reference.outputs else reference.grads[name]
            assert_close(f"{case.label} {name}", value, expected, bound)
        print(
            _report(
                case,
                {
                    name: relative_error(value, reference.outputs.get(name, reference.grads.get(name)))
                    for name, (value, _) in errors.items()
                },
            )
        )
    assert step._cache_size() == 1
