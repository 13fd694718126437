"""The `reference` implementations registered through the `gla` entry point, used via dispatch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
from gla_ref.testing import check_against_oracle, make_case

pytestmark = pytest.mark.oracle

OPS = ("simple_gla", "gla", "kda", "kda_gate")


def _reference(op):
    return lambda **kwargs: gla_core.dispatch(op, impl="reference", **kwargs)


def test_registered_for_every_op():
    for op in OPS:
        (impl,) = [i for i in gla_core.implementations(op) if i.name == "reference"]
        assert impl.priority == 0
        assert impl.backends == frozenset({"cpu", "gpu", "tpu"})
        assert impl.package == "gla-ref"
        assert impl.description


DISPATCH_CASES = {
    "simple_gla-g+g_gamma-varlen-h0-ht": dict(
        op="simple_gla", gates=("g", "g_gamma"), cu_seqlens=[0, 9, 9, 40], initial_state=True, output_final_state=True
    ),
    "gla-batch-h0": dict(op="gla", batch=2, initial_state=True),
    "kda-grouped-all-flags-ht": dict(
        op="kda",
        num_value_heads=4,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        lower_bound=-5.0,
        use_beta_sigmoid_in_kernel=True,
        initial_state=True,
        output_final_state=True,
    ),
    "kda_gate-lower_bound": dict(op="kda_gate", lower_bound=-3.0),
}


@pytest.mark.parametrize("options", list(DISPATCH_CASES.values()), ids=list(DISPATCH_CASES))
def test_dispatch_reference_matches_oracle_with_gradients(options):
    """Outputs and every gradient through `dispatch(..., impl="reference")`; float32 tolerance."""
    options = dict(options)
    op = options.pop("op")
    case = make_case(op, seq_len=40, key_dim=16, value_dim=16, **options)
    errors = check_against_oracle(_reference(op), case)
    assert len(errors) > 2


def test_dtypes_follow_the_contract():
    case = make_case("kda", seq_len=8, key_dim=8, value_dim=8, dtype=jnp.bfloat16, initial_state=True)
    o, final_state = gla_core.dispatch("kda", impl="reference", **case.inputs, output_final_state=True)
    assert o.dtype == jnp.bfloat16 and final_state.dtype == jnp.float32
    o, final_state = gla_core.dispatch("kda", impl="reference", **case.inputs)
    assert final_state is None
    gate_case = make_case("kda_gate", seq_len=4, key_dim=8)
    gate = gla_core.dispatch("kda_gate", impl="reference", **gate_case.inputs, output_dtype=jnp.bfloat16)
    assert gate.dtype == jnp.bfloat16 and gate.shape == (1, 4, 2, 8)
    assert gla_core.dispatch("kda_gate", impl="reference", **gate_case.inputs).dtype == jnp.float32


def test_float64_inputs_keep_a_float64_state(x64):
    case = make_case("gla", seq_len=8, key_dim=4, value_dim=4)
    inputs = {n: jnp.asarray(np.asarray(x, np.float64)) for n, x in case.inputs.items()}
    o, final_state = gla_core.dispatch("gla", impl="reference", **inputs, output_final_state=True)
    assert o.dtype == jnp.float64 and final_state.dtype == jnp.float64


def test_grad_and_jit_through_dispatch_with_positional_arrays():
    case = make_case("simple_gla", seq_len=24, key_dim=8, value_dim=8, cu_seqlens=[0, 5, 24], initial_state=True)
    q, k, v, g, h0 = (case.inputs[n] for n in ("q", "k", "v", "g", "initial_state"))

    def loss(q, g, h0, cu):
        o, final_state = gla_core.dispatch(
            "simple_gla", q, k, v, g=g, initial_state=h0, cu_seqlens=cu, output_final_state=True, impl="reference"
        )
        return jnp.sum(o**2) + jnp.sum(final_state)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    for boundaries in ([0, 5, 24], [0, 17, 24]):
        grads = grad(q, g, h0, jnp.asarray(boundaries, jnp.int32))
        for name, x in zip(("q", "g", "initial_state"), grads, strict=True):
            assert np.isfinite(np.asarray(x)).all() and np.abs(np.asarray(x)).max() > 0, name
    assert grad._cache_size() == 1  # new boundaries, same program
