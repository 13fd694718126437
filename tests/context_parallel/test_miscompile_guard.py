"""No compiled context-parallel program holds the XLA:CPU miscompile's pattern (a dot reading a
broadcast scalar inside a reducing fusion, `gla_ref.testing.dots_on_broadcast_scalars`). The dense
transition is the risky one: it feeds the implementation zero value columns and identity states.
Compiled with XLA's default optimizations (the fusions in question only exist then)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from gla_ref import testing

from . import checks

pytestmark = pytest.mark.oracle


def test_dense_packed_training_step():
    case = checks.case("kda-packed")
    fn = checks.sharded(case.op, "cp4", "xla")
    names = case.differentiable
    constant = {n: x for n, x in case.inputs.items() if n not in names}

    def forward(values):
        return fn(**dict(zip(names, values, strict=True)), **constant, **case.options)

    def training(values):
        out, vjp = jax.vjp(forward, values)
        return vjp(jax.tree.map(jnp.ones_like, out))

    text = jax.jit(training).lower(tuple(case.inputs[n] for n in names)).compile().as_text()
    assert not testing.dots_on_broadcast_scalars(text)
