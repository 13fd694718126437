"""Many shapes through `xla` and `recurrent` in one process, against the float64 oracle.

XLA:CPU in jaxlib 0.10.2 miscompiles a `__ynn_fusion` that holds a reduction and a dot whose
operand is a broadcast scalar: the dot reads uninitialised memory, so the result depends on what
ran before in the process (minimal form: `jnp.sum(x, -1, keepdims=True) + x @ jnp.zeros((64, 64))`
under `jax.jit`). A zero state that XLA can see as a constant (no initial state and a single
chunk, or an unused final-state cotangent) used to feed such a dot. These sweeps run the shapes
that exposed it one after another in one process: forward only (as a user calls it), forward
and VJP, and gradients taken while the final state is returned but unused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
from gla_ref import testing

pytestmark = pytest.mark.oracle

# (B, T, H, K, V, chunk): single-chunk and multi-chunk, the reproducer shapes first.
SHAPES = [
    (1, 64, 1, 64, 16, 64),
    (1, 64, 1, 64, 64, 64),
    (2, 64, 1, 64, 16, 64),
    (1, 37, 4, 64, 32, 64),
    (1, 16, 2, 32, 128, 16),
    (2, 100, 2, 64, 64, 128),
    (1, 130, 1, 64, 64, 64),
    (1, 1, 1, 64, 64, 64),
]
GATES = {"simple_gla": dict(gates=("g",)), "simple_gla-no-gate": dict(gates=()), "gla": {}}
IMPLS = ["xla", "recurrent"]
TOL = testing.TOLERANCES["float32"]


def _case(name, shape, seed, **flags):
    batch, seq_len, heads, key_dim, value_dim, chunk = shape
    dims = dict(batch=batch, seq_len=seq_len, num_heads=heads, key_dim=key_dim, value_dim=value_dim, chunk_size=chunk)
    return testing.make_case(name.split("-")[0], seed=seed, **dims, **GATES[name], **flags)


def _dispatcher(impl, op):
    return lambda **kwargs: gla_core.dispatch(op, impl=impl, **kwargs)


def _sweep():
    for index, shape in enumerate(SHAPES):
        for name in GATES:
            yield index, shape, name


@pytest.mark.parametrize("impl", IMPLS)
def test_forward_sweep_in_one_process(impl):
    for index, shape, name in _sweep():
        for initial_state in (False, True):
            case = _case(name, shape, index, initial_state=initial_state, output_final_state=True)
            o, final = _dispatcher(impl, case.op)(**case.kwargs())
            reference = testing.oracle(case).outputs
            testing.assert_close("o", o, reference["o"], TOL.output, label=f"{case.label} {impl}")
            testing.assert_close("final_state", final, reference["final_state"], TOL.output, label=case.label)


@pytest.mark.parametrize("impl", IMPLS)
def test_forward_and_vjp_sweep_in_one_process(impl):
    for index, shape, name in _sweep():
        case = _case(name, shape, index, initial_state=index % 2 == 1, output_final_state=index % 3 != 0)
        testing.check_against_oracle(_dispatcher(impl, case.op), case)


def _grads_of_o_only(case, impl, dtype):
    """d(sum(o * w))/d(q, k, v) with the final state returned but unused (a symbolic-zero cotangent)."""
    arrays = tuple(jnp.asarray(np.asarray(case.inputs[n]), dtype) for n in ("q", "k", "v"))
    gates = {n: jnp.asarray(np.asarray(x), dtype) for n, x in case.inputs.items() if n not in ("q", "k", "v")}
    w = jnp.asarray(np.random.default_rng(0).standard_normal(case.inputs["v"].shape), dtype)

    def loss(q, k, v):
        o, _ = gla_core.dispatch(case.op, q, k, v, impl=impl, **gates, **case.options)
        return jnp.sum(o * w)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*arrays)


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_with_an_unused_final_state(impl):
    for index, shape, name in _sweep():
        case = _case(name, shape, index, output_final_state=True)
        grads = _grads_of_o_only(case, impl, jnp.float32)
        with jax.enable_x64(True):
            expected = _grads_of_o_only(case, "reference", jnp.float64)
        for grad_name, got, want in zip(("dq", "dk", "dv"), grads, expected, strict=True):
            testing.assert_close(grad_name, got, want, TOL.grad, label=f"{case.label} {impl} o-only")


# Shapes that exercise single-chunk, single-sub-chunk (chunk 16) and multi-sub-chunk layouts.
HLO_SHAPES = [(1, 64, 1, 64, 64, 64), (1, 99, 3, 179, 8, 16), (2, 37, 2, 32, 16, 32), (1, 1, 1, 8, 8, 16)]


@pytest.mark.parametrize("impl", IMPLS)
def test_no_dot_reads_a_broadcast_scalar(impl):
    """The XLA:CPU miscompile's pattern is absent from every compiled program (forward alone,
    forward + VJP), with and without an initial state, whatever ran before."""
    for index, shape in enumerate(HLO_SHAPES):
        for name in GATES:
            for initial_state in (False, True):
                case = _case(name, shape, index, initial_state=initial_state, output_final_state=True)
                fn = _dispatcher(impl, case.op)
                static = {n: x for n, x in case.options.items() if n != "cu_seqlens"}

                def forward(inputs, fn=fn, static=static):
                    return fn(**inputs, **static)

                def training(inputs, forward=forward):
                    out, vjp = jax.vjp(forward, inputs)
                    return vjp(jax.tree.map(jnp.ones_like, out))

                for program in (forward, training):
                    hlo = jax.jit(program).lower(case.inputs).compile().as_text()
                    found = testing.dots_on_broadcast_scalars(hlo)
                    assert not found, f"{case.label} {impl} {program.__name__}: {found}"
