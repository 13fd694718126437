"""Registration, dispatch on CPU, the FLA-named functions and jax.vmap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import gla_core
import gla_simple
from gla_ref import testing
from gla_simple import functions

pytestmark = pytest.mark.oracle

H0_HT = dict(initial_state=True, output_final_state=True)


@pytest.mark.parametrize("op", ["simple_gla", "gla"])
def test_registered_with_priorities(op):
    by_name = {impl.name: impl for impl in gla_core.implementations(op) if impl.package == "gla-simple"}
    assert by_name["xla"].priority == 50 and by_name["xla"].backends == {"cpu", "gpu", "tpu"}
    assert by_name["recurrent"].priority == 10 and by_name["recurrent"].backends == {"cpu", "gpu", "tpu"}


@pytest.mark.parametrize("op", ["simple_gla", "gla"])
def test_dispatch_chooses_xla_on_cpu(op):
    case = testing.make_case(op, seq_len=100, **H0_HT)
    structs = {n: jax.ShapeDtypeStruct(x.shape, x.dtype) for n, x in case.inputs.items()}
    resolution = gla_core.explain(op, **structs, **case.options)
    assert resolution.call.backend == "cpu"
    assert resolution.winner.name == "xla"
    assert gla_core.explain(op, **structs, **case.options, among=functions.CHUNK_FAMILY).winner.name == "xla"


@pytest.mark.parametrize("op", ["simple_gla", "gla"])
def test_chunk_functions_use_the_pallas_chunk_when_it_accepts(op):
    """In TPU interpret mode the `chunk` implementation accepts, and the chunk_* functions pick it."""
    if "chunk" not in {impl.name for impl in gla_core.implementations(op)}:
        pytest.skip("no `chunk` implementation registered")
    case = testing.make_case(op, seq_len=100)
    structs = {n: jax.ShapeDtypeStruct(x.shape, x.dtype) for n, x in case.inputs.items()}
    with gla_core.use(interpret=True):
        assert gla_core.explain(op, **structs, **case.options, among=functions.CHUNK_FAMILY).winner.name == "chunk"


def _fla_cases():
    simple = testing.make_case("simple_gla", gates=("g", "g_gamma"), seq_len=50, chunk_size=16, **H0_HT)
    gla = testing.make_case("gla", seq_len=50, cu_seqlens=[0, 20, 20, 50], chunk_size=16, **H0_HT)
    no_gate = testing.make_case("simple_gla", gates=(), seq_len=50, **H0_HT)

    def chunk_gla(q, k, v, gk, chunk_size, **kwargs):
        return gla_simple.chunk_gla(q, k, v, gk, chunk_size=chunk_size, **kwargs)

    def chunk_simple_gla(**kwargs):
        return gla_simple.chunk_simple_gla(**kwargs)

    def fused_recurrent_gla_without_gate(chunk_size, **kwargs):
        return gla_simple.fused_recurrent_gla(**kwargs)

    return {
        "chunk_simple_gla": (chunk_simple_gla, simple),
        "chunk_gla": (chunk_gla, gla),
        "fused_recurrent_gla-no-gate": (fused_recurrent_gla_without_gate, no_gate),
    }


FLA_CASES = _fla_cases()


@pytest.mark.parametrize("name", FLA_CASES)
def test_fla_functions_against_oracle(name):
    fn, case = FLA_CASES[name]
    testing.check_against_oracle(fn, case)


def test_fused_recurrent_functions_forward():
    """fused_recurrent_gla with a gate and fused_recurrent_simple_gla (the decode path) match the oracle."""
    gla_case = testing.make_case("gla", seq_len=20, key_dim=8, value_dim=8, **H0_HT)
    simple_case = testing.make_case("simple_gla", gates=("g", "g_gamma"), seq_len=20, key_dim=8, value_dim=8, **H0_HT)
    for case, fn in ((gla_case, gla_simple.fused_recurrent_gla), (simple_case, gla_simple.fused_recurrent_simple_gla)):
        o, final = fn(**case.inputs, output_final_state=True)
        reference = testing.oracle(case)
        testing.assert_close(f"{fn.__name__} o", o, reference.outputs["o"], testing.TOLERANCES["float32"].output)
        testing.assert_close(
            f"{fn.__name__} final_state", final, reference.outputs["final_state"], testing.TOLERANCES["float32"].output
        )


@pytest.mark.parametrize("impl", ["xla", "recurrent"])
def test_vmap_over_a_leading_axis(impl):
    """jax.vmap of forward and gradient over a leading axis equals the per-slice results."""
    shape = dict(batch=2, seq_len=40, key_dim=16, value_dim=8, chunk_size=16)
    cases = [testing.make_case("gla", seed=seed, **shape) for seed in range(3)]
    stacked = {n: jnp.stack([c.inputs[n] for c in cases]) for n in ("q", "k", "v", "gk")}

    def loss(q, k, v, gk):
        o, _ = gla_core.dispatch("gla", q, k, v, gk=gk, impl=impl, chunk_size=16)
        return jnp.sum(jnp.sin(o)), o

    value_and_grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    (_, o_batched), grads_batched = jax.jit(jax.vmap(value_and_grad))(*stacked.values())
    single = jax.jit(value_and_grad)
    for p, case in enumerate(cases):
        (_, o), grads = single(*(case.inputs[n] for n in ("q", "k", "v", "gk")))
        testing.assert_close(f"o[{p}]", o_batched[p], o, testing.TOLERANCES["float32_rearranged"].output)
        for name, g_batched, g in zip(("dq", "dk", "dv", "dgk"), grads_batched, grads, strict=True):
            testing.assert_close(f"{name}[{p}]", g_batched[p], g, testing.TOLERANCES["float32_rearranged"].grad)
