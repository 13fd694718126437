"""`gla_core.kit.any_nonfinite`: the same answer as `jnp.any(~jnp.isfinite(x))` for every axis and dtype."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from gla_core.kit import any_nonfinite


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("axis", [-1, 0, 2])
@pytest.mark.parametrize("keepdims", [False, True])
def test_any_nonfinite_matches_jnp_any(dtype, axis, keepdims):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 4, 16)).astype(np.float32) * 1e30  # large finite values stay finite in float32
    flat = x.reshape(-1)
    for value, count in ((np.nan, 7), (np.inf, 5), (-np.inf, 5)):
        flat[rng.choice(flat.size, count, replace=False)] = value
    x = jnp.asarray(x, dtype)
    expected = jnp.any(~jnp.isfinite(x), axis=axis, keepdims=keepdims)
    got = any_nonfinite(x, axis=axis, keepdims=keepdims)
    assert got.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert np.asarray(expected).any() and not np.asarray(expected).all()
