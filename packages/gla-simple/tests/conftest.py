"""Fixtures for gla-simple tests: implementations run under one `jax.jit` per case."""

from __future__ import annotations

import pytest

from gla_ref.testing import jit_dispatch


@pytest.fixture
def jitted():
    """`jitted(impl, case) -> fn` for `gla_ref.testing.check_against_oracle(fn, case)`."""
    return jit_dispatch
