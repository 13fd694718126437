"""The `xla` implementations of simple_gla and gla against the float64 oracle of gla-ref.

Tolerances are gla_ref.testing.TOLERANCES (f32: 1e-5 outputs and final state, 1e-4 gradients;
bf16: the looser bounds stated there with their reasons). Every case compares o, the final
state when requested, and the gradients of every float input (q, k, v, g, g_gamma, gk,
initial_state) with the oracle's seeded cotangents.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from gla_ref import testing

pytestmark = pytest.mark.oracle

H0_HT = dict(initial_state=True, output_final_state=True)

SIMPLE_CASES = {
    "g-T1024-K64-c64": dict(gates=("g",), seq_len=1024, key_dim=64, value_dim=64, chunk_size=64, **H0_HT),
    "g+gamma-T300-K48-V100-c128": dict(
        gates=("g", "g_gamma"), seq_len=300, key_dim=48, value_dim=100, chunk_size=128, **H0_HT
    ),
    "gamma-T100-K8-V8-c16-B2": dict(gates=("g_gamma",), batch=2, seq_len=100, key_dim=8, value_dim=8, chunk_size=16),
    "none-T77-K160-V48-c32": dict(gates=(), seq_len=77, key_dim=160, value_dim=48, chunk_size=32, **H0_HT),
    "g-T1-h0": dict(gates=("g",), seq_len=1, key_dim=32, value_dim=16, chunk_size=64, **H0_HT),
}

GLA_CASES = {
    "T512-K64-c64": dict(seq_len=512, key_dim=64, value_dim=64, chunk_size=64, **H0_HT),
    "T200-K100-V160-c128": dict(seq_len=200, key_dim=100, value_dim=160, chunk_size=128, **H0_HT),
    "T45-K8-V8-c16-B2": dict(batch=2, seq_len=45, key_dim=8, value_dim=8, chunk_size=16, gate_scale=3.0),
    "T100-K48-c32-scale": dict(seq_len=100, key_dim=48, value_dim=32, chunk_size=32, scale=0.3, **H0_HT),
}


@pytest.mark.parametrize("name", SIMPLE_CASES)
def test_simple_gla_f32(jitted, name):
    case = testing.make_case("simple_gla", **SIMPLE_CASES[name])
    errors = testing.check_against_oracle(jitted("xla", case), case)
    assert set(errors) == {*case.output_names, *("d" + name for name in case.differentiable)}


@pytest.mark.parametrize("name", GLA_CASES)
def test_gla_f32(jitted, name):
    case = testing.make_case("gla", **GLA_CASES[name])
    errors = testing.check_against_oracle(jitted("xla", case), case)
    assert set(errors) == {*case.output_names, *("d" + name for name in case.differentiable)}


@pytest.mark.parametrize("op", ["simple_gla", "gla"])
def test_bf16(jitted, op):
    """bf16 inputs: f32 compute, o in bf16, final state in f32, within the stated bf16 bounds."""
    gates = dict(gates=("g", "g_gamma")) if op == "simple_gla" else {}
    case = testing.make_case(
        op, seq_len=200, key_dim=64, value_dim=48, chunk_size=64, dtype=jnp.bfloat16, **gates, **H0_HT
    )
    fn = jitted("xla", case)
    o, final = fn(**case.kwargs())
    assert o.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    testing.check_against_oracle(fn, case)


def _with_constant_decay(case: testing.Case, name: str, value: float) -> testing.Case:
    inputs = dict(case.inputs)
    inputs[name] = jnp.full(inputs[name].shape, value, inputs[name].dtype)
    return dataclasses.replace(case, inputs=inputs, label=f"{case.label} {name}={value}")


@pytest.mark.parametrize(
    "op, gate",
    [("simple_gla", "g_gamma"), ("gla", "gk")],
)
def test_large_decay_chunk128(jitted, op, gate):
    """-10 per step (exp(-1280) over a chunk of 128) stays finite and matches the oracle."""
    gates = dict(gates=(gate,)) if op == "simple_gla" else {}
    case = testing.make_case(op, seq_len=300, key_dim=32, value_dim=32, chunk_size=128, **gates, **H0_HT)
    case = _with_constant_decay(case, gate, -10.0)
    fn = jitted("xla", case)
    o, final = fn(**case.kwargs())
    assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(final)))
    errors = testing.check_against_oracle(fn, case)
    assert set(errors) >= {"o", "final_state", "dq", "dk", "dv", "d" + gate, "dinitial_state"}
