"""`xla` and `recurrent` on unusual inputs, against the float64 oracle.

- hard resets: gates of -inf (decay exactly 0) in g, g_gamma and gk, at chunk and sequence
  boundaries; the gradient with respect to a -inf gate is 0, as the recurrence's;
- causality: a nan or inf in q, k or v at step t changes no output before t, nor other rows,
  heads or packed sequences;
- float64 inputs (x64 on) are computed in float64 (`TOLERANCES["float64"]`);
- empty inputs: B = 0, T = 0 and packed sequences that are all empty.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
from gla_ref import testing

pytestmark = pytest.mark.oracle

IMPLS = ["xla", "recurrent"]
REARRANGED = testing.TOLERANCES["float32_rearranged"]


def _dispatcher(impl, op):
    return lambda **kwargs: gla_core.dispatch(op, impl=impl, **kwargs)


RESETS = {
    # simple_gla g: -inf at the first step, at a chunk boundary (16), inside a chunk and at the last step
    "simple_gla-g": (
        dict(op="simple_gla", gates=("g",), batch=2, seq_len=50, chunk_size=16),
        "g",
        [(0, 0, 0), (0, 16, 1), (1, 23, 0), (1, 49, 1)],
    ),
    "simple_gla-g+g_gamma-varlen": (
        dict(op="simple_gla", gates=("g", "g_gamma"), seq_len=70, cu_seqlens=[0, 20, 21, 70], chunk_size=16),
        "g",
        [(0, 19, 0), (0, 21, 1), (0, 40, 0)],
    ),
    "simple_gla-g_gamma-head": (
        dict(op="simple_gla", gates=("g_gamma",), seq_len=40, chunk_size=16),
        "g_gamma",
        [(1,)],
    ),
    "gla-gk-some-keys": (
        dict(op="gla", batch=2, seq_len=45, chunk_size=16),
        "gk",
        [(0, 0, 0, 3), (0, 17, 1, 0), (1, 31, 0, 5), (1, 32, 0, 5), (0, 44, 1, 7)],
    ),
    "gla-gk-all-keys-varlen": (
        dict(op="gla", seq_len=60, cu_seqlens=[0, 33, 60], chunk_size=32),
        "gk",
        [(0, 10, 0, slice(None)), (0, 33, 1, slice(None))],
    ),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", RESETS)
def test_hard_resets_match_the_oracle(impl, name):
    options, gate, positions = RESETS[name]
    options = dict(options)
    op = options.pop("op")
    case = testing.make_case(op, key_dim=8, value_dim=8, initial_state=True, output_final_state=True, **options)
    for index in positions:
        case = testing.with_values(case, gate, [index], -np.inf)
    errors = testing.check_against_oracle(_dispatcher(impl, op), case)
    assert all(np.isfinite(e) for e in errors.values()), errors


@pytest.mark.parametrize("impl", IMPLS)
def test_gradient_of_a_minus_inf_gate_is_zero(impl):
    case = testing.make_case("gla", seq_len=40, key_dim=8, value_dim=8, chunk_size=16, output_final_state=True)
    case = testing.with_values(case, "gk", [(0, 20, 1, 2)], -np.inf)
    gk = case.inputs["gk"]

    def loss(gk):
        o, final = gla_core.dispatch("gla", **{**case.kwargs(), "gk": gk}, impl=impl)
        return jnp.sum(o) + jnp.sum(final)

    dgk = jax.jit(jax.grad(loss))(gk)
    assert bool(jnp.all(jnp.isfinite(dgk)))
    assert float(dgk[0, 20, 1, 2]) == 0.0


CAUSALITY = {
    "simple_gla": dict(op="simple_gla", gates=("g",), batch=2, seq_len=50, num_heads=2, chunk_size=16),
    "gla": dict(op="gla", batch=2, seq_len=50, num_heads=2, chunk_size=16),
    "gla-varlen": dict(op="gla", seq_len=60, num_heads=2, cu_seqlens=[0, 21, 22, 60], chunk_size=16),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", CAUSALITY)
@pytest.mark.parametrize(
    "tensor, value", [("k", np.nan), ("v", np.inf), ("v", np.nan), ("q", np.nan), ("gate", np.nan)]
)
def test_a_non_finite_input_affects_no_earlier_output(impl, name, tensor, value):
    options = dict(CAUSALITY[name])
    op = options.pop("op")
    case = testing.make_case(op, key_dim=8, value_dim=8, initial_state=True, output_final_state=True, **options)
    step, row, head = 37, 0, 1  # inside a chunk of 16 (32..47); for varlen, in the third sequence
    tensor = {"simple_gla": "g", "gla": "gk"}[op] if tensor == "gate" else tensor
    poisoned = testing.with_values(case, tensor, [(row, step, head)], value)
    static = {n: x for n, x in case.options.items() if n != "cu_seqlens"}
    run = jax.jit(lambda arrays: gla_core.dispatch(op, impl=impl, **arrays, **static))
    arrays = lambda c: {**c.inputs, "cu_seqlens": c.options["cu_seqlens"]}
    o, final = run(arrays(case))
    o_bad, final_bad = run(arrays(poisoned))
    last_clean = step + 1 if tensor == "q" else step  # q only reaches its own step's output
    testing.assert_close("o before the step", o_bad[row, :step, head], o[row, :step, head], REARRANGED.output)
    if tensor == "q":
        testing.assert_close("o after the step", o_bad[row, last_clean:, head], o[row, last_clean:, head], 0.0)
        assert not bool(jnp.any(jnp.isfinite(o_bad[row, step, head]))), "the step's own output stays finite"
    else:  # the state is non-finite from the step on, as in the recurrence: no finite output after it
        assert not bool(jnp.any(jnp.isfinite(o_bad[row, step:, head]))), "a later output stays finite"
    testing.assert_close("other heads", o_bad[:, :, 1 - head], o[:, :, 1 - head], REARRANGED.output)
    if case.options["cu_seqlens"] is None:
        testing.assert_close("other rows", o_bad[1 - row], o[1 - row], REARRANGED.output)
        testing.assert_close("final state, other rows", final_bad[1 - row], final[1 - row], REARRANGED.output)
    else:
        testing.assert_close("final states, earlier sequences", final_bad[:2], final[:2], REARRANGED.output)
    testing.assert_close("final state, other heads", final_bad[:, 1 - head], final[:, 1 - head], REARRANGED.output)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "options",
    [
        dict(op="simple_gla", gates=("g", "g_gamma"), seq_len=70, chunk_size=32),
        dict(op="gla", seq_len=45, chunk_size=16, cu_seqlens=[0, 20, 20, 45]),
    ],
    ids=["simple_gla", "gla-varlen"],
)
def test_float64_inputs_are_computed_in_float64(impl, options):
    options = dict(options)
    op = options.pop("op")
    with jax.enable_x64(True):
        case = testing.make_case(
            op, key_dim=16, value_dim=16, dtype=jnp.float64, initial_state=True, output_final_state=True, **options
        )
        case = dataclasses.replace(case, inputs={n: x.astype(jnp.float64) for n, x in case.inputs.items()})
        o, final = _dispatcher(impl, op)(**case.kwargs())
        assert o.dtype == jnp.float64 and final.dtype == jnp.float64
        errors = testing.check_against_oracle(_dispatcher(impl, op), case)
    assert max(errors.values()) <= testing.TOLERANCES["float64"].output


EMPTY = {
    "B0": dict(batch=0, seq_len=9),
    "T0": dict(batch=2, seq_len=0),
    "varlen-all-empty": dict(batch=1, seq_len=0, cu_seqlens=[0, 0, 0]),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", ["simple_gla", "gla"])
@pytest.mark.parametrize("name", EMPTY)
def test_empty_inputs(impl, op, name):
    shape = EMPTY[name]
    batch, seq_len = shape["batch"], shape["seq_len"]
    heads, key_dim, value_dim = 2, 8, 4
    cu = shape.get("cu_seqlens")
    num_states = batch if cu is None else len(cu) - 1
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((batch, seq_len, heads, key_dim)), jnp.float32)
    v = jnp.zeros((batch, seq_len, heads, value_dim), jnp.float32)
    gate = {"g": jnp.zeros((batch, seq_len, heads))} if op == "simple_gla" else {"gk": jnp.zeros(q.shape)}
    h0 = jnp.asarray(rng.standard_normal((num_states, heads, key_dim, value_dim)), jnp.float32)
    dht = jnp.asarray(rng.standard_normal(h0.shape), jnp.float32)
    extra = {} if cu is None else {"cu_seqlens": jnp.asarray(cu, jnp.int32)}

    def loss(q, v, h0):
        o, final = gla_core.dispatch(op, q, q, v, **gate, initial_state=h0, output_final_state=True, impl=impl, **extra)
        return jnp.sum(o) + jnp.sum(final * dht), (o, final)

    (_, (o, final)), (dq, dv, dh0) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, v, h0)
    assert o.shape == v.shape and dq.shape == q.shape and dv.shape == v.shape
    testing.assert_close("final_state", final, h0, 0.0)
    testing.assert_close("d initial_state", dh0, dht, 0.0)
    o_none, final_none = gla_core.dispatch(op, q, q, v, **gate, output_final_state=True, impl=impl, **extra)
    assert o_none.shape == v.shape and final_none.shape == h0.shape and not bool(jnp.any(final_none))
