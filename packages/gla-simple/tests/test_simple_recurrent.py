"""The `recurrent` implementations of simple_gla and gla against the float64 oracle of gla-ref.

Tolerances: gla_ref.testing.TOLERANCES (f32 1e-5 outputs, 1e-4 gradients; bf16 as stated there).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from gla_ref import testing

pytestmark = pytest.mark.oracle

H0_HT = dict(initial_state=True, output_final_state=True)

CASES = {
    "simple-g+gamma-T200-K48-V100": (
        "simple_gla",
        dict(gates=("g", "g_gamma"), seq_len=200, key_dim=48, value_dim=100),
    ),
    "simple-decode-T1": ("simple_gla", dict(gates=("g_gamma",), seq_len=1, key_dim=64, value_dim=64)),
    "gla-T130-K8-V160-c32": ("gla", dict(seq_len=130, key_dim=8, value_dim=160, chunk_size=32)),
    "gla-decode-B2-T1": ("gla", dict(batch=2, seq_len=1, key_dim=32, value_dim=48)),
    "gla-varlen": ("gla", dict(seq_len=120, cu_seqlens=[0, 0, 1, 50, 51, 51, 120], chunk_size=16)),
    "simple-varlen": ("simple_gla", dict(gates=("g",), seq_len=90, cu_seqlens=[0, 37, 37, 38, 90], chunk_size=32)),
}


@pytest.mark.parametrize("name", CASES)
def test_recurrent_f32(jitted, name):
    op, options = CASES[name]
    case = testing.make_case(op, **options, **H0_HT)
    testing.check_against_oracle(jitted("recurrent", case), case)


def test_recurrent_bf16(jitted):
    case = testing.make_case("gla", seq_len=100, key_dim=48, value_dim=32, dtype=jnp.bfloat16, **H0_HT)
    testing.check_against_oracle(jitted("recurrent", case), case)


def test_recurrent_large_decay(jitted):
    """g_gamma = -10 per step: finite and equal to the oracle (checkpoint segments of 128 steps)."""
    case = testing.make_case("simple_gla", gates=("g_gamma",), seq_len=200, chunk_size=128, **H0_HT)
    inputs = dict(case.inputs, g_gamma=jnp.full_like(case.inputs["g_gamma"], -10.0))
    case = dataclasses.replace(case, inputs=inputs, label=case.label + " g_gamma=-10")
    fn = jitted("recurrent", case)
    o, final = fn(**case.kwargs())
    assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(final)))
    testing.check_against_oracle(fn, case)
