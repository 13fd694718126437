"""FLA's kda options against the float64 oracle (outputs and every gradient).

allow_neg_eigval (beta = 2 sigmoid), safe_gate with and without the in-kernel gate, a lower bound on
a precomputed g, A_log=None with a lower bound, A_log in FLA's [1, 1, HV, 1] layout,
disable_recompute, state_v_first, return_intermediate_states (the state entering every chunk), and
the same gate options of fused_kda_gate. Each case combines several options; the Pallas `chunk`
pipeline runs one combination in TPU interpret mode, with and without disable_recompute, and
declines the option it cannot honour (return_intermediate_states).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
from gla_core.pallas_jaxpr import pallas_equations
from gla_core.static_profile import call_name
from gla_kda import chunk_kda, fused_kda_gate
from gla_ref import chunk_states, recurrent
from gla_ref.testing import TOLERANCES, assert_close, check_against_oracle, jit_dispatch, make_case

SHAPE = dict(seq_len=40, num_heads=1, num_value_heads=2, key_dim=16, value_dim=24)


def _v_first(fn):
    """`fn` called with [N, HV, V, K] states (`state_v_first=True`), seen from outside as [N, HV, K, V]."""

    def run(initial_state=None, **kwargs):
        swap = lambda x: None if x is None else jnp.swapaxes(x, -1, -2)
        o, final_state = fn(initial_state=swap(initial_state), state_v_first=True, **kwargs)
        return o, swap(final_state)

    return run


def _with(case, label, drop=(), **changes):
    """`case` with inputs changed (`changes`) or dropped (`drop`), and options added (`options=`)."""
    options = {**case.options, **changes.pop("options", {})}
    inputs = {n: x for n, x in {**case.inputs, **changes}.items() if n not in drop}
    differentiable = tuple(n for n in inputs if n in case.differentiable or n in changes)
    return dataclasses.replace(
        case, inputs=inputs, options=options, differentiable=differentiable, label=f"{case.label} {label}"
    )


def _gate_without_a_log(**extra):
    case = make_case("kda", **SHAPE, use_gate_in_kernel=True, lower_bound=-3.0, initial_state=True, **extra)
    return _with(case, "A_log=None", drop=("A_log",))


def _fla_a_log_layout(case):
    a_log = case.inputs["A_log"].reshape(1, 1, -1, 1)
    return _with(case, "A_log[1,1,HV,1] safe_gate", A_log=a_log, options=dict(safe_gate=True))


CASES = {
    # beta in (0, 2), the gate lower_bound * sigmoid(g + dt_bias) without A_log, [V, K] states, kept intermediates
    "xla neg_eigval A_log=None state_v_first disable_recompute": (
        lambda **kw: _v_first(lambda **k: gla_core.dispatch("kda", impl="xla", **k))(**kw),
        lambda: _with(
            _gate_without_a_log(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, output_final_state=True),
            "disable_recompute",
            options=dict(disable_recompute=True),
        ),
    ),
    # FLA's safe-gate calls with a precomputed g in [lower_bound, 0]
    "recurrent safe_gate g>=-5 disable_recompute": (
        lambda **kw: gla_core.dispatch("kda", impl="recurrent", **kw),
        lambda: _with(
            make_case("kda", **SHAPE, lower_bound=-5.0, initial_state=True, output_final_state=True, seed=1),
            "safe_gate disable_recompute",
            options=dict(safe_gate=True, disable_recompute=True),
        ),
    ),
    # the in-kernel gate with a lower bound in FLA's safe range, A_log as FLA's [1, 1, HV, 1]
    "chunk_kda safe_gate A_log[1,1,HV,1]": (
        lambda A_log, **kw: chunk_kda(A_log=A_log, **kw),
        lambda: _fla_a_log_layout(
            make_case("kda", **SHAPE, use_gate_in_kernel=True, lower_bound=-5.0, output_final_state=True, seed=2)
        ),
    ),
}


@pytest.mark.oracle
@pytest.mark.parametrize("name", sorted(CASES))
def test_options_against_the_oracle(name):
    fn, build = CASES[name]
    check_against_oracle(fn, build())


@pytest.mark.interpret
@pytest.mark.parametrize("disable_recompute", [False, True])
def test_chunk_pipeline_with_fla_options(interpret, disable_recompute):
    case = _gate_without_a_log(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, output_final_state=True)
    case = dataclasses.replace(case, options={**case.options, "chunk_size": 16, "disable_recompute": disable_recompute})
    run = lambda **kw: gla_core.dispatch("kda", impl="chunk", interpret=interpret, **kw)
    check_against_oracle(_v_first(run), case)


def _abstract_call():
    """Abstract arrays of a small kda call (q, k, v) and its gates."""
    shape = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.float32)
    arrays = (shape(1, 64, 1, 16), shape(1, 64, 1, 16), shape(1, 64, 2, 16))
    return arrays, dict(g=shape(1, 64, 2, 16), beta=shape(1, 64, 2))


def test_chunk_declines_what_it_cannot_honour():
    arrays, gates = _abstract_call()
    option = "return_intermediate_states"
    resolution = gla_core.explain("kda", *arrays, **gates, **{option: True}, interpret=True, among=("chunk", "xla"))
    assert resolution.winner.name == "xla"
    assert option in {c.implementation.name: c.reason for c in resolution.candidates}["chunk"]
    kept = gla_core.explain("kda", *arrays, **gates, disable_recompute=True, interpret=True, among=("chunk", "xla"))
    assert kept.winner.name == "chunk"


@pytest.mark.parametrize("disable_recompute", [False, True])
def test_disable_recompute_keeps_the_forward_states(disable_recompute):
    """The training step runs the state kernel once. By default it writes o and the poison rows
    only, and the gradient kernel recomputes the per-chunk states walking time in order; with
    disable_recompute it also writes the states, and the gradient kernel's chunks are independent."""
    arrays, gates = _abstract_call()

    def loss(q, k, v, g, beta):
        o, _ = gla_core.dispatch(
            "kda", q, k, v, g=g, beta=beta, impl="chunk", interpret=True, disable_recompute=disable_recompute
        )
        return jnp.sum(o)

    closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*arrays, *gates.values())
    calls = {}
    for eqn in pallas_equations(closed.jaxpr):
        calls.setdefault(call_name(eqn), []).append(eqn)
    assert sorted((name, len(eqns)) for name, eqns in calls.items()) == [
        ("kda_intra", 1),
        ("kda_intra_bwd", 1),
        ("kda_state", 1),
        ("kda_state_bwd", 1),
    ]
    (state,), (grads,) = calls["kda_state"], calls["kda_intra_bwd"]
    assert len(state.outvars) == (3 if disable_recompute else 2)  # (h), o, poison rows
    time_axis = grads.params["compiler_params"].dimension_semantics[2]
    assert time_axis == ("parallel" if disable_recompute else "arbitrary")


def _oracle_chunk_states(case, boundaries, chunk_size, v_first):
    """The state entering every chunk from the float64 token-by-token recurrence."""
    with jax.enable_x64(True):
        up = {n: jnp.asarray(np.asarray(x, np.float64)) for n, x in case.inputs.items()}
        cu = case.options["cu_seqlens"]
        _, _, states = recurrent.kda(**up, cu_seqlens=cu, token_states=True)
        initial = up["initial_state"]
        h = np.asarray(chunk_states.states_before_chunks(states, initial, chunk_size, boundaries))
    return np.swapaxes(h, -1, -2) if v_first else h


@pytest.mark.oracle
def test_return_intermediate_states():
    """Packed sequences (one of them empty) in the [V, K] layout; chunks of 16 tokens."""
    cu_seqlens, v_first = [0, 17, 17, 40], True
    case = make_case("kda", **SHAPE, cu_seqlens=cu_seqlens, initial_state=True, chunk_size=16, seed=3)
    arrays = {n: case.inputs[n] for n in ("q", "k", "v", "g", "beta")}
    h0 = jnp.swapaxes(case.inputs["initial_state"], -1, -2)
    cu = jnp.asarray(cu_seqlens, jnp.int32)

    @jax.jit
    def run(arrays, h0, cu):  # cu traced: the host copy gives the number of chunks
        return chunk_kda(
            **arrays, initial_state=h0, cu_seqlens=cu, cu_seqlens_cpu=cu_seqlens, state_v_first=v_first,
            return_intermediate_states=True, chunk_size=16,
        )  # fmt: skip

    _, final_state, h = run(arrays, h0, cu)
    expected = _oracle_chunk_states(case, cu_seqlens, 16, v_first)
    assert final_state is None and h.dtype == arrays["q"].dtype and h.shape == expected.shape
    assert_close("intermediate states", h, expected, TOLERANCES["float32"].output, label=case.label)
    with pytest.raises(gla_core.errors.InvalidArgumentError, match="return_intermediate_states"):
        chunk_kda(**arrays, return_intermediate_states=True, disable_recompute=True)
    with pytest.raises(gla_core.errors.InvalidArgumentError, match="cu_seqlens_cpu"):
        jax.jit(lambda cu: chunk_kda(**arrays, cu_seqlens=cu, return_intermediate_states=True))(cu)


@pytest.mark.oracle
def test_fused_kda_gate_lower_bound_without_a_log_and_fla_a_log_layout():
    case = make_case("kda_gate", seq_len=20, num_heads=3, key_dim=8, lower_bound=-4.0)
    check_against_oracle(fused_kda_gate, _with(case, "A_log=None", drop=("A_log",)))
    flat = make_case("kda_gate", seq_len=20, num_heads=3, key_dim=8, seed=1)
    check_against_oracle(fused_kda_gate, _with(flat, "A_log[1,1,HV,1]", A_log=flat.inputs["A_log"].reshape(1, 1, 3, 1)))
    with pytest.raises(gla_core.errors.InvalidArgumentError, match="A_log"):
        fused_kda_gate(flat.inputs["g"])  # neither A_log nor a lower bound


def test_jit_dispatch_runs_the_options():
    """The options reach the implementations as static values under one jit (jit_dispatch)."""
    case = make_case("kda", **SHAPE, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    o, _ = jit_dispatch("recurrent", case)(**case.kwargs())
    plain = dataclasses.replace(case, options={**case.options, "allow_neg_eigval": False})
    o_plain, _ = jit_dispatch("recurrent", plain)(**plain.kwargs())
    assert not np.allclose(np.asarray(o), np.asarray(o_plain))  # beta in (0, 2) really changed the result
