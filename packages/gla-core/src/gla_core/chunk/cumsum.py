"""In-kernel cumulative log decays of every chunk, as compensated float32 pairs.

A decay exponent is a segment sum `b_t - b_s = sum_{s<u<=t} a_u`. Taken as the difference of
two float32 cumulative sums it carries the rounding of the sums themselves (with a decay of
-10 per step the sums reach -1280 in a chunk of 128 and keep ~1e-4 absolute precision), so the
cumulative sums are kept as (hi, lo) pairs: `hi` the float32 sum, `lo` the exact rounding error
of every addition (TwoSum), accumulated in float32. Then

    b_t - b_s = (hi_t - hi_s) + (lo_t - lo_s)

is accurate to float32 precision of the segment itself (`lo` itself is rounded too, at the scale
of its own magnitude, a few ulps of `hi`). The scan is a Hillis-Steele scan along lanes (log2(C)
steps of lane rotations): a few vector ops per vreg of gates and no matmul.

Hard resets (a log decay of -inf, decay exactly 0) enter floored at `CUMSUM_GATE_FLOOR` = -4096,
not at the -1e30 of `gates.GATE_FLOOR`: e^{-4096 + x} is exactly 0 in float32 for any x < 3990
(everything below -104 underflows), so every decay across a reset is still exactly 0 (as is the
gradient of a floored gate, the derivative of e^a at -inf), while 128 floored steps keep |hi| <
2^19, its ulp <= 1/16 and the accumulated `lo` small; -1e30 would make `lo` carry errors of
1e23 and lose every exponent after a second reset in the chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

CUMSUM_GATE_FLOOR = -4096.0


def floor_cumsum_gates(a: jax.Array) -> jax.Array:
    """Log decays with -inf and anything below `CUMSUM_GATE_FLOOR` raised to it; NaN stays NaN."""
    return jnp.maximum(a, CUMSUM_GATE_FLOOR)


def two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(s, e)` with `s = fl(a + b)` and `a + b = s + e` exactly (Knuth's TwoSum)."""
    s = a + b
    b_virtual = s - a
    return s, (a - (s - b_virtual)) + (b - b_virtual)


def chunk_cumsum(a: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
    """Inclusive cumulative sums along the last axis, restarting every `chunk` lanes.

    Args:
      a: [R, N] float32 per-step log decays (N a multiple of `chunk`, `chunk` a power of two).
      chunk: C, the segment length.

    Returns:
      (hi, lo), each [R, N] float32: `hi + lo` is the cumulative sum within the chunk through
      each step, `lo` the accumulated rounding error of `hi`.
    """
    if chunk & (chunk - 1):
        raise ValueError(f"chunk: expected a power of two, got {chunk}")
    position = jax.lax.broadcasted_iota(jnp.int32, a.shape, a.ndim - 1) % chunk
    hi, lo = a, jnp.zeros_like(a)
    shift = 1
    while shift < chunk:
        reaches = position >= shift
        hi_before = jnp.where(reaches, pltpu.roll(hi, shift, a.ndim - 1), 0.0)
        lo_before = jnp.where(reaches, pltpu.roll(lo, shift, a.ndim - 1), 0.0)
        hi, error = two_sum(hi, hi_before)
        lo = lo + lo_before + error
        shift *= 2
    return hi, lo
