"""gla_core.pallas_jaxpr and gla_core.static_profile: finding the Pallas calls of a program, replacing
them with empty kernels, and profiling a program kernel by kernel for a compile-only TPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from gla_core import static_profile
from gla_core.pallas_jaxpr import STUB_NAME, pallas_equations, stub_kernels

ROWS, LANES = 256, 128
STRUCT = jax.ShapeDtypeStruct((ROWS, LANES), jnp.float32)


def _scaled(factor: float, name: str):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * factor

    def call(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), name=name)(x)

    return call


@jax.custom_vjp
def _with_vjp(x):
    return _scaled(3.0, "forward")(x)


def _with_vjp_fwd(x):
    return _with_vjp(x), None


def _with_vjp_bwd(_, g):
    return (_scaled(3.0, "backward")(g),)


_with_vjp.defvjp(_with_vjp_fwd, _with_vjp_bwd)


def _program(x):
    """Three Pallas calls: one at top level, one in a nested jit, one inside a scan body."""
    y = _scaled(2.0, "first")(x)
    y = jax.jit(_scaled(0.5, "second"))(y)
    y, _ = jax.lax.scan(lambda carry, _: (_scaled(1.0, "third")(carry), None), y, None, length=2)
    return jnp.sin(y)


def _names(eqns) -> list[str]:
    return [eqn.params["name"] for eqn in eqns]


def test_pallas_equations_are_found_in_nested_jaxprs_in_program_order():
    closed = jax.make_jaxpr(_program)(STRUCT)
    assert _names(pallas_equations(closed.jaxpr)) == ["first", "second", "third"]


def test_pallas_equations_of_a_custom_vjp_training_step():
    closed = jax.make_jaxpr(jax.grad(lambda x: _with_vjp(x).sum()))(STRUCT)
    assert _names(pallas_equations(closed.jaxpr)) == ["forward", "backward"]


def test_stub_kernels_keep_every_operand_and_result_and_do_no_work():
    closed = jax.make_jaxpr(_program)(STRUCT)
    stubbed = stub_kernels(closed)
    before, after = pallas_equations(closed.jaxpr), pallas_equations(stubbed.jaxpr)
    assert _names(after) == [STUB_NAME] * len(before)
    for real, stub in zip(before, after, strict=True):
        assert [v.aval for v in stub.invars] == [v.aval for v in real.invars]
        assert [v.aval for v in stub.outvars] == [v.aval for v in real.outvars]
    assert stubbed.out_avals == closed.out_avals
    # The original program is left as it was.
    assert _names(pallas_equations(closed.jaxpr)) == ["first", "second", "third"]


def test_kernel_name_drops_the_uniquifying_suffix():
    assert static_profile.kernel_name("chunk_fwd.12") == "chunk_fwd"
    assert static_profile.kernel_name("chunk_fwd") == "chunk_fwd"


def test_with_kernels_sums_cycles_and_keeps_the_largest_scoped_vmem():
    whole = static_profile.ProgramProfile("v6e", {}, (), 100, 50, 7)
    alone = [
        static_profile.ProgramProfile("v6e", {"fwd": 10}, (), 0, 0, 0, kernel_vmem={"fwd": 4096}),
        static_profile.ProgramProfile("v6e", {"fwd": 5, "bwd": 20}, (), 0, 0, 0, kernel_vmem={"fwd": 8192}),
    ]
    merged = static_profile.with_kernels(whole, alone)
    assert merged.kernel_cycles == {"fwd": 15, "bwd": 20} and merged.pallas_cycles == 35
    assert merged.kernel_vmem == {"fwd": 8192}
    assert (merged.argument_bytes, merged.output_bytes, merged.temp_bytes) == (100, 50, 7)


def test_profile_round_trips_through_json():
    profile = static_profile.ProgramProfile(
        "v6e",
        {"fwd": 10},
        (static_profile.XlaOp("copy.1", "copy", 64, 3),),
        100,
        50,
        7,
        kernel_vmem={"fwd": 4096},
        pallas_calls=1,
    )
    assert static_profile.ProgramProfile.from_json(profile.to_json()) == profile


@pytest.mark.tpu_compile
def test_profile_by_kernel_of_a_small_forward():
    spec = {
        "program": "attention",
        "op": "simple_gla",
        "batch": 1,
        "seq_len": 256,
        "heads": 16,
        "gate": "g",
        "impl": "chunk",
        "stage": "fwd",
        "chip": "v6e",
    }
    profile = static_profile.profile_by_kernel(spec)
    assert profile.pallas_calls >= 1
    assert set(profile.kernel_cycles) == set(profile.kernel_vmem)
    assert all(cycles > 0 for cycles in profile.kernel_cycles.values())
    assert all(vmem > 0 for vmem in profile.kernel_vmem.values())
    assert profile.argument_bytes > 0 and profile.output_bytes > 0
