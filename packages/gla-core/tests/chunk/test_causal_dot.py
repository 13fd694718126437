"""`common.causal_dot` (plain JAX, the same code the kernels trace) against its float64 formula, and the
row/column moves of the kernels.

`scores @ x` for a causal `scores` must give every row t the float64 product over s <= t while
the rows of x from the first non-finite one on are never multiplied into an earlier row: rows
before it match the formula, every row from it on is NaN.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from gla_core.chunk.common import causal_dot, column_to_row, row_to_column
from gla_ref.testing import TOLERANCES, assert_close

CHUNK, WIDTH = 32, 128


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bad_step, value", [(None, None), (0, np.nan), (13, np.inf), (31, -np.inf), (20, np.nan)])
def test_causal_dot_keeps_non_finite_rows_out_of_earlier_rows(bad_step, value, dtype):
    rng = np.random.default_rng(0)
    scores = np.tril(rng.standard_normal((CHUNK, CHUNK)))
    x = rng.standard_normal((CHUNK, WIDTH))
    if bad_step is not None:
        x[bad_step, 5] = value
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)  # the rounded inputs
    got = np.asarray(causal_dot(jnp.asarray(scores, dtype), jnp.asarray(x, dtype), dtype), np.float64)
    clean = len(x) if bad_step is None else bad_step
    expected = np.asarray(jnp.asarray(scores, dtype).astype(jnp.float32), np.float64)[:clean, :clean] @ x[:clean]
    # inputs are compared after their rounding to dtype: what is left is float32 accumulation
    assert_close("rows before the non-finite step", got[:clean], expected, TOLERANCES["float32_building_block"].output)
    assert np.isnan(got[clean:]).all()


def test_row_column_transposes():
    """`row_to_column` / `column_to_row` (the kernels' [1, C] <-> [C, 1] moves without a transpose op)."""
    row = jnp.arange(8, dtype=jnp.float32)[None, :]
    np.testing.assert_array_equal(row_to_column(row), row.T)
    np.testing.assert_array_equal(column_to_row(row.T), row)
