"""The `fused_chunk` implementation in TPU interpret mode against the float64 oracle.

Outputs, final states and every gradient (dq, dk, dv, dg, dg_gamma, dinitial_state) with
the default tolerance of the input dtype (`gla_ref.testing.TOLERANCES`: float32 1e-5 for
outputs, 1e-4 for gradients). Each case combines several situations: every gate kind (g,
g_gamma, g + g_gamma, none), h0/ht, a decay of -10 per step at chunk 128, T not a multiple
of the chunk, K/V not multiples of 128, one and several chunks per grid step and grid steps
per sequence, bf16 (head pairs). The tokens per grid step change nothing but the grid.
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
    (kernel_chunk, block_tokens)."""

    def fn(**kwargs):
        impl_options = {"fused_chunk": options}
        return gla_core.dispatch(
            "simple_gla", impl="fused_chunk", interpret=interpret, impl_options=impl_options, **kwargs
        )

    return fn


DISPATCH_CASES = {
    # |g| * C = 1280: only overflow-safe, cancellation-free exponents keep the small gate
    # gradient (a non-finite value is an infinite error). Two grid steps of one chunk of 128.
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
    """The kernels' chunk is the case's chunk size, 64 tokens per grid step at most."""
    case = DISPATCH_CASES[name]()
    options = dict(kernel_chunk=case.options["chunk_size"], block_tokens=64)
    errors = check_against_oracle(dispatched(interpret, **options), case)
    assert set(errors) >= {"o", "dq", "dk", "dv"}


def test_padded_time_several_chunks_per_step_and_wide_tiles_match_oracle(interpret, no_races):
    """T = 90 at kernel chunk 16 pads to 96 = 6 chunks; at most 64 tokens per grid step gives 3
    chunks (48 tokens) per step, 2 steps. K = 160 and V = 150 are not multiples of 128 lanes. The
    batch rows run on two simulated cores with race detection."""
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
    config = FusedConfig.create(
        q, v, scale=None, output_final_state=True, interpret=True, kernel_chunk=16, block_tokens=64
    )
    assert (config.block_tokens, config.padded_len) == (48, 96)
    errors = check_against_oracle(dispatched(interpret, kernel_chunk=16, block_tokens=64), case)
    assert set(errors) == {"o", "final_state", "dq", "dk", "dv", "dg", "dinitial_state"}


def test_chunk_256_matches_oracle(interpret):
    """The v6e default kernel chunk (256, one chunk per grid step, all of T = 256) with g and a
    g_gamma of -10 per step (|a| * C = 2560 and more), h0 and ht: the [256, 256] decay matrices stay
    overflow-safe and every output and gradient matches the oracle."""
    case = make_case(
        "simple_gla",
        seq_len=256,
        key_dim=32,
        value_dim=48,
        gates=("g", "g_gamma"),
        chunk_size=64,
        initial_state=True,
        output_final_state=True,
        seed=6,
    )
    case = _with_inputs(case, g_gamma=jnp.full((2,), -10.0, jnp.float32))
    errors = check_against_oracle(dispatched(interpret, kernel_chunk=256, block_tokens=256), case)
    assert set(errors) == {"o", "final_state", "dq", "dk", "dv", "dg", "dg_gamma", "dinitial_state"}


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


def test_tokens_per_grid_step_change_nothing(interpret):
    """g + g_gamma, T = 128 at kernel chunk 16 (8 chunks): 8, 4, 2 and 1 chunks per grid step match
    the oracle and each other within the float32 rearrangement bound (each chunk is computed the
    same way whatever the grid; the bound leaves room for a compiler's reassociation)."""
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
    results = {
        steps: _outputs_and_grads(dispatched(interpret, kernel_chunk=16, block_tokens=16 * steps), case)
        for steps in (8, 4, 2, 1)
    }
    reference = oracle(case)
    expected = {**reference.outputs, **reference.grads}
    assert set(results[8]) == set(expected)
    tol, rearranged = TOLERANCES["float32"], TOLERANCES["float32_rearranged"]
    for name, ref in expected.items():
        assert_close(name, results[8][name], ref, tol.output if name in reference.outputs else tol.grad)
        for steps in (4, 2, 1):
            assert_close(f"{name}, {steps} chunks per step", results[steps][name], results[8][name], rearranged.output)
