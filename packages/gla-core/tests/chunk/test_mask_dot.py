"""`mask_dot`, the segment sums of the per-key gate: float32 accuracy from three bfloat16 passes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_core.chunk.common import bfloat16_parts, mask_dot, split_for_mask_dot
from gla_ref.testing import TOLERANCES

CHUNK, KEYS = 64, 128


def _log_decays(seed: int) -> np.ndarray:
    """[C, K] float32 log decays spanning every magnitude the kernels see: hard resets floored at
    -1e30, strong (-10) and weak (-1e-6) decays, zeros, and values with full 24-bit mantissas."""
    rng = np.random.default_rng(seed)
    magnitude = 10.0 ** rng.uniform(-7, 1.5, (CHUNK, KEYS))
    a = -(magnitude * rng.uniform(0.5, 1.0, (CHUNK, KEYS)))
    a[rng.random((CHUNK, KEYS)) < 0.02] = -1e30
    a[rng.random((CHUNK, KEYS)) < 0.02] = 0.0
    return a.astype(np.float32)


@pytest.mark.parametrize("seed", range(3))
def test_bfloat16_parts_sum_to_the_input_exactly(seed):
    x = _log_decays(seed)
    parts = jax.jit(bfloat16_parts)(jnp.asarray(x))
    total = sum(np.asarray(p.astype(jnp.float32), np.float64) for p in parts)
    np.testing.assert_array_equal(total, x.astype(np.float64))


@pytest.mark.parametrize("seed", range(3))
def test_segment_sums_are_float32_accurate_in_every_row(seed):
    """Each segment sum is held to float32 accumulation accuracy of its own terms (the bound of a
    float32 matmul), so a short segment of tiny decays is exact beside segments through a reset."""
    a = _log_decays(seed)
    rows, cols = np.indices((CHUNK, CHUNK))
    masks = {"through t": cols <= rows, "after t": cols > rows, "band": (cols > rows - 5) & (cols <= rows)}
    segment_sums = jax.jit(lambda mask, x: mask_dot(mask, split_for_mask_dot(x)[None])[0])
    for name, mask in masks.items():
        result = np.asarray(segment_sums(jnp.asarray(mask), jnp.asarray(a)), np.float64)
        reference = mask.astype(np.float64) @ a.astype(np.float64)
        scale = mask.astype(np.float64) @ np.abs(a.astype(np.float64))
        error = np.abs(result - reference) / np.maximum(scale, np.finfo(np.float32).tiny)
        bound = TOLERANCES["float32_accumulation"].output
        assert error.max() <= bound, f"{name}: relative error {error.max():.2e} > {bound:.0e}"
