"""Fixtures for gla-kda tests: implementations run under one `jax.jit` per case."""

from __future__ import annotations

import jax
import pytest

import gla_core
from gla_ref.testing import Case


def jit_dispatch(impl: str, case: Case):
    """`fn(**case.kwargs())` running `dispatch(case.op, impl=impl)` under `jax.jit`.

    Non-array options (flags, scale, chunk_size, lower_bound) are static; arrays, including
    `cu_seqlens`, are traced, as in a training step.
    """
    static = {name: value for name, value in case.options.items() if not isinstance(value, jax.Array)}

    @jax.jit
    def run(arrays):
        return gla_core.dispatch(case.op, impl=impl, **arrays, **static)

    def fn(**kwargs):
        return run({name: value for name, value in kwargs.items() if name not in static})

    return fn


@pytest.fixture
def jitted():
    """`jitted(impl, case) -> fn` for `gla_ref.testing.check_against_oracle(fn, case)`."""
    return jit_dispatch
