"""Packed variable-length sequences (`cu_seqlens`) for the `xla` implementations.

Boundaries are not multiples of the chunk, with length-1 and length-0 sequences (also at the
ends); every sequence has its own initial state and final state.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
from gla_ref import testing

pytestmark = pytest.mark.oracle

REARRANGED = testing.TOLERANCES["float32_rearranged"]

H0_HT = dict(initial_state=True, output_final_state=True)


@pytest.mark.parametrize(
    "op, options",
    [
        (
            "simple_gla",
            dict(gates=("g", "g_gamma"), seq_len=200, cu_seqlens=[0, 1, 1, 70, 131, 200, 200], chunk_size=32),
        ),
        ("gla", dict(seq_len=100, key_dim=48, value_dim=24, cu_seqlens=[0, 0, 45, 46, 100], chunk_size=16)),
    ],
    ids=["simple_gla", "gla"],
)
def test_varlen_against_oracle(jitted, op, options):
    case = testing.make_case(op, **options, **H0_HT)
    testing.check_against_oracle(jitted("xla", case), case)


@pytest.mark.parametrize("impl", ["xla", "recurrent"])
def test_packed_input_without_tokens_returns_the_initial_states(impl):
    """T = 0 with N = 2 empty sequences: o is empty, each final state is its initial state."""
    case = testing.make_case("simple_gla", gates=("g",), seq_len=0, cu_seqlens=[0, 0, 0], chunk_size=16, **H0_HT)
    o, final = gla_core.dispatch("simple_gla", impl=impl, **case.kwargs())
    assert o.shape == (1, 0, 2, 32)
    np.testing.assert_array_equal(final, case.inputs["initial_state"])


def test_varlen_equals_per_sequence_runs():
    """Each packed sequence gives the outputs and final state of running it alone (B=1, no cu_seqlens)."""
    cu = [0, 5, 5, 6, 70, 75]
    case = testing.make_case("simple_gla", gates=("g",), seq_len=cu[-1], cu_seqlens=cu, chunk_size=32, **H0_HT)
    inputs = case.inputs
    packed_o, packed_final = gla_core.dispatch("simple_gla", impl="xla", **case.kwargs())
    for n, (start, end) in enumerate(itertools.pairwise(cu)):
        if start == end:
            np.testing.assert_array_equal(packed_final[n], inputs["initial_state"][n])
            continue
        o, final = gla_core.dispatch(
            "simple_gla",
            inputs["q"][:, start:end],
            inputs["k"][:, start:end],
            inputs["v"][:, start:end],
            impl="xla",
            g=inputs["g"][:, start:end],
            initial_state=inputs["initial_state"][n : n + 1],
            output_final_state=True,
            chunk_size=32,
        )
        testing.assert_close(f"o of sequence {n}", packed_o[:, start:end], o, REARRANGED.output)
        testing.assert_close(f"final state of sequence {n}", packed_final[n : n + 1], final, REARRANGED.output)


@pytest.mark.parametrize("impl", ["xla", "recurrent"])
def test_changing_boundaries_does_not_recompile(impl):
    """Under jax.jit, new cu_seqlens values with the same N and T reuse the compiled step."""
    boundaries = ([0, 3, 3, 40, 64], [0, 30, 31, 31, 64])
    cases = [
        testing.make_case("gla", seq_len=64, key_dim=16, value_dim=16, cu_seqlens=cu, chunk_size=16, **H0_HT)
        for cu in boundaries
    ]
    traces = []

    @jax.jit
    def step(q, k, v, gk, h0, cu_seqlens):
        traces.append(cu_seqlens)

        def loss(q, k, v, gk, h0):
            o, final = gla_core.dispatch(
                "gla",
                q,
                k,
                v,
                impl=impl,
                gk=gk,
                initial_state=h0,
                output_final_state=True,
                cu_seqlens=cu_seqlens,
                chunk_size=16,
            )
            return jnp.sum(o * o) + jnp.sum(final), (o, final)

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, gk, h0)

    for case in cases:
        arrays = (case.inputs[n] for n in ("q", "k", "v", "gk", "initial_state"))
        (_, (o, final)), grads = step(*arrays, case.options["cu_seqlens"])
        reference = testing.oracle(case)
        testing.assert_close("o", o, reference.outputs["o"], testing.TOLERANCES["float32"].output)
        testing.assert_close(
            "final_state", final, reference.outputs["final_state"], testing.TOLERANCES["float32"].output
        )
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
    assert len(traces) == 1
    assert step._cache_size() == 1
