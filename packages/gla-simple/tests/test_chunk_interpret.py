"""The `chunk` implementations end to end (dispatch, TPU interpret mode) against the float64 oracle.

Outputs, final states and every gradient, with the default tolerance of the input dtype
(`gla_ref.testing.TOLERANCES`). Each case combines several of the situations the kernels
must handle (T not a multiple of the chunk, K/V not multiples of 128, h0/ht, every gate
kind, every chunk size, varlen with unaligned, length-1 and length-0 sequences, extreme
decays, bf16); the kernels alone are tested in gla-core's tests/chunk.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import gla_core
from gla_ref.testing import TOLERANCES, assert_close, check_against_oracle, make_case, oracle

pytestmark = pytest.mark.interpret


def chunk_fn(op: str, interpret: bool):
    """`fn(**case.kwargs())` through dispatch, forcing the `chunk` implementation (in interpret mode off TPU)."""
    return lambda **kwargs: gla_core.dispatch(op, impl="chunk", interpret=interpret, **kwargs)


def _with_inputs(case, **inputs):
    return dataclasses.replace(case, inputs={**case.inputs, **inputs})


CASES = {
    # |g| * C = 1280: the gradients only match when no exponent overflows and no cancellation
    # loses the small gate gradient (a non-finite value is an infinite error).
    "g_gamma=-10 chunk 128": lambda: _with_inputs(
        make_case(
            "simple_gla",
            seq_len=200,
            key_dim=40,
            value_dim=72,
            gates=("g_gamma",),
            chunk_size=128,
            initial_state=True,
            output_final_state=True,
        ),
        g_gamma=jnp.full((2,), -10.0, jnp.float32),
    ),
    # per-key decays down to -20 per step
    "gk fast decays chunk 128": lambda: make_case(
        "gla",
        seq_len=150,
        key_dim=24,
        value_dim=56,
        chunk_size=128,
        gate_scale=4.0,
        initial_state=True,
        output_final_state=True,
        seed=2,
    ),
    "varlen g+g_gamma chunk 16": lambda: make_case(
        "simple_gla",
        seq_len=60,
        num_heads=1,
        key_dim=48,
        value_dim=100,
        gates=("g", "g_gamma"),
        cu_seqlens=[0, 0, 1, 13, 13, 40, 60],
        chunk_size=16,
        initial_state=True,
        output_final_state=True,
        seed=3,
    ),
    "varlen gk chunk 64": lambda: make_case(
        "gla",
        seq_len=140,
        num_heads=1,
        key_dim=100,
        value_dim=48,
        cu_seqlens=[0, 37, 38, 38, 140, 140],
        chunk_size=64,
        initial_state=True,
        output_final_state=True,
        seed=4,
    ),
    "bf16 g chunk 64": lambda: make_case(
        "simple_gla",
        batch=2,
        seq_len=100,
        gates=("g",),
        chunk_size=64,
        dtype=jnp.bfloat16,
        initial_state=True,
        output_final_state=True,
        seed=5,
    ),
    "bf16 gk chunk 32": lambda: make_case(
        "gla", batch=2, seq_len=70, chunk_size=32, dtype=jnp.bfloat16, output_final_state=True, seed=6
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_chunk_matches_oracle(name, interpret):
    case = CASES[name]()
    errors = check_against_oracle(chunk_fn(case.op, interpret), case)
    assert set(errors) >= {"o", "dq", "dk", "dv"}


def test_varlen_boundaries_do_not_recompile(interpret):
    """Only the boundaries change (same N and T): one trace, one compile, both runs correct (no gate)."""
    traces = []

    @jax.jit
    def run(q, k, v, initial_state, cu_seqlens):
        traces.append(cu_seqlens)
        return gla_core.dispatch(
            "simple_gla",
            q,
            k,
            v,
            initial_state=initial_state,
            output_final_state=True,
            cu_seqlens=cu_seqlens,
            chunk_size=16,
            impl="chunk",
            interpret=interpret,
        )

    for boundaries in ([0, 0, 1, 20, 20, 47, 60], [0, 25, 26, 26, 50, 59, 60]):
        case = make_case(
            "simple_gla",
            seq_len=60,
            num_heads=1,
            gates=(),
            cu_seqlens=boundaries,
            initial_state=True,
            output_final_state=True,
            seed=7,
        )
        arrays = (case.inputs[name] for name in ("q", "k", "v", "initial_state"))
        o, final_state = run(*arrays, case.options["cu_seqlens"])
        reference = oracle(case).outputs
        assert_close("o", o, reference["o"], TOLERANCES["float32"].output)
        assert_close("final_state", final_state, reference["final_state"], TOLERANCES["float32"].output)
    assert len(traces) == 1
    assert run._cache_size() == 1
