"""The `fused_chunk` implementation in TPU interpret mode against the float64 oracle.

Outputs, final states and every gradient (dq, dk, dv, dg, dg_gamma, dinitial_state) with
the default tolerance of the input dtype (`gla_ref.testing.TOLERANCES`: float32 1e-5 for
outputs, 1e-4 for gradients). Each case combines several situations: every gate kind (g,
g_gamma, g + g_gamma, none), h0/ht, a decay of -10 per step at chunk 128, T not a multiple
of the chunk, K/V not multiples of 128 with V in two tiles, NT = 1, 2, a number of chunks
num_steps does not divide, bf16. num_steps 8, 4, 2 and 1 differ only in summation order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
from gla_fused.fused_chunk.pipeline import FusedConfig
from gla_ref.testing import TOLERANCES, assert_close, check_against_oracle, cotangents, make_case, oracle

pytestmark = pytest.mark.interpret


def _with_inputs(case, **inputs):
    return dataclasses.replace(case, inputs={**case.inputs, **inputs})


def dispatched(interpret: bool, **options):
    """`fn(**case.kwargs())` through dispatch, forcing `fused_chunk` with per-call `options`
    (num_steps, block_v, block_k)."""

    def fn(**kwargs):
        impl_options = {"fused_chunk": options}
        return gla_core.dispatch(
            "simple_gla", impl="fused_chunk", interpret=interpret, impl_options=impl_options, **kwargs
        )

    return fn


DISPATCH_CASES = {
    # |g| * C = 1280: only overflow-safe, cancellation-free exponents keep the small gate
    # gradient (a non-finite value is an infinite error). NT = 2: num_steps 8 -> 2.
    "g_gamma=-10 chunk 128 NT=2 h0 ht": lambda: _with_inputs(
        make_case(
            "simple_gla",
            seq_len=256,
            key_dim=40,
            value_dim=72,
            gates=("g_gamma",),
            chunk_size=128,
            initial_state=True,
            output_final_state=True,
        ),
        g_gamma=jnp.full((2,), -10.0, jnp.float32),
    ),
    "no gate NT=1 T<C ht scale": lambda: make_case(
        "simple_gla",
        batch=2,
        seq_len=50,
        key_dim=64,
        value_dim=96,
        gates=(),
        chunk_size=64,
        output_final_state=True,
        scale=0.3,
        seed=1,
    ),
    "bf16 g chunk 32 h0 ht": lambda: make_case(
        "simple_gla",
        batch=2,
        seq_len=128,
        gates=("g",),
        chunk_size=32,
        dtype=jnp.bfloat16,
        initial_state=True,
        output_final_state=True,
        seed=5,
    ),
}


@pytest.mark.parametrize("name", list(DISPATCH_CASES))
def test_fused_chunk_matches_oracle(name, interpret):
    case = DISPATCH_CASES[name]()
    errors = check_against_oracle(dispatched(interpret), case)
    assert set(errors) >= {"o", "dq", "dk", "dv"}


def test_partial_num_steps_and_two_value_tiles_match_oracle(interpret, no_races):
    """T = 90 at chunk 16 is NT = 6 chunks (the last one partial): num_steps 4 runs 3 chunks per
    grid iteration. K = 160 and V = 150 pad to 256; 128-wide tiles split V (fused kernels)
    and K (dq/dk/dgate kernel) in two. The parallel tiles, heads and batch rows run on two simulated
    cores with race detection."""
    case = make_case(
        "simple_gla",
        batch=2,
        seq_len=90,
        key_dim=160,
        value_dim=150,
        gates=("g",),
        chunk_size=16,
        initial_state=True,
        output_final_state=True,
        seed=2,
    )
    q, v = case.inputs["q"], case.inputs["v"]
    assert FusedConfig.create(q, v, chunk_size=16, num_steps=4).num_steps == 3
    errors = check_against_oracle(dispatched(interpret, num_steps=4, block_v=128, block_k=128), case)
    assert set(errors) == {"o", "final_state", "dq", "dk", "dv", "dg", "dinitial_state"}


def _outputs_and_grads(fn, case) -> dict[str, np.ndarray]:
    """fn's outputs and VJP with the oracle's cotangents, keyed like `gla_ref.testing.oracle`."""
    names = case.differentiable
    q, v = case.inputs["q"], case.inputs["v"]
    shapes = {"o": v.shape, "final_state": (q.shape[0], q.shape[2], q.shape[3], v.shape[3])}
    cts = cotangents(case, shapes, seed=0)

    @jax.jit
    def run(values):
        def forward(*values):
            return fn(**dict(zip(names, values, strict=True)), **case.options)

        outputs, vjp = jax.vjp(forward, *values)
        o, final_state = outputs
        return outputs, vjp((jnp.asarray(cts["o"], o.dtype), jnp.asarray(cts["final_state"], final_state.dtype)))

    (o, final_state), grads = run(tuple(case.inputs[n] for n in names))
    result = {"o": o, "final_state": final_state, **{"d" + n: x for n, x in zip(names, grads, strict=True)}}
    return {name: np.asarray(x) for name, x in result.items()}


def test_num_steps_change_only_the_summation_order(interpret):
    """g + g_gamma, T = 128 at chunk 16 (NT = 8): 8, 4, 2 and 1 chunks per grid iteration match the
    oracle and each other within the float32 rearrangement bound (the chunks of an iteration are
    batched into one matmul, whose summation order may depend on the batch size)."""
    case = make_case(
        "simple_gla",
        seq_len=128,
        key_dim=48,
        value_dim=40,
        gates=("g", "g_gamma"),
        chunk_size=16,
        initial_state=True,
        output_final_state=True,
        seed=3,
    )
    results = {steps: _outputs_and_grads(dispatched(interpret, num_steps=steps), case) for steps in (8, 4, 2, 1)}
    reference = oracle(case)
    expected = {**reference.outputs, **reference.grads}
    assert set(results[8]) == set(expected)
    tol, rearranged = TOLERANCES["float32"], TOLERANCES["float32_rearranged"]
    for name, ref in expected.items():
        assert_close(name, results[8][name], ref, tol.output if name in reference.outputs else tol.grad)
        for steps in (4, 2, 1):
            assert_close(f"{name}, num_steps={steps}", results[steps][name], results[8][name], rearranged.output)
