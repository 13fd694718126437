"""The gated intra-chunk products of a per-key gate, for all chunks of a grid step at once.

Both kinds take `[M, C, ...]` operands (M chunks, any mix of heads and time, along a leading
axis) and give, with b_t the sum of a chunk's log decays through step t:

  scores(x, y)              M_ts   = sum_k x_tk y_sk e^{b_tk - b_sk}   [M, C, C], zero for s > t
  left_right_strict(w, y, x), for w strictly lower triangular:
                            left_t  = sum_{s<t} w_ts y_s e^{b_t - b_s}   [M, C, K]
                            right_s = sum_{t>s} w_ts x_t e^{b_t - b_s}   [M, C, K]

`AnchoredProducts`: one matmul per product from the anchored factors of `anchored.StepDecays`;
valid only where the step is within the anchor range (the fast path).
`LevelProducts`: exact for any gates (every exponent a segment sum <= 0), one masked matmul per
level: the kernels' recompute of a step out of range.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_core.chunk.anchored import StepDecays
from gla_core.chunk.batched import causal_mask
from gla_core.chunk.common import BATCHED_NN, BATCHED_NT, BATCHED_TN, dot, mask_dot, split_for_mask_dot
from gla_core.chunk.gates import KeyMaskTable

F32 = jnp.float32


class AnchoredProducts:
    """The gated products from the anchored factors e^{D} (rows) and e^{-D} (columns) of `decays`."""

    def __init__(self, decays: StepDecays, dtype):
        self.decays = decays
        self.dtype = dtype

    def scores(self, x: jax.Array, y: jax.Array) -> jax.Array:
        d = self.decays
        scores = dot(x * d.row_factor, y * d.column_factor, BATCHED_NT, self.dtype)
        return jnp.where(causal_mask(*scores.shape[:2]), scores, 0.0)

    def left_right_strict(self, w: jax.Array, y: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        d = self.decays
        left = d.row_factor * dot(w, y * d.column_factor, BATCHED_NN, self.dtype)
        right = d.column_factor * dot(w, x * d.row_factor, BATCHED_TN, self.dtype)
        return left, right


class LevelProducts:
    """The exact gated products, batched over the leading axis.

    Pairs t > s are split by the highest bit where t and s differ: at level l both lie in one block
    of 2^(l+1) steps, t in its upper half and s in its lower half, and with r the last step of the
    lower half e^{b_t - b_s} = e^{b_t - b_r} e^{b_r - b_s}, both exponents segment sums <= 0.

    Args:
      a: `[M*C, K]` float32 per-step log decays (floored); table_ref: the call's `KeyMaskTable` ref.
      chunk: C; dtype: the matrix-unit dtype.
    """

    def __init__(self, a: jax.Array, table_ref, chunk: int, dtype):
        self.table = KeyMaskTable(chunk)
        self.table_ref = table_ref
        self.chunk = chunk
        self.dtype = dtype
        self.chunks = a.shape[0] // chunk
        self._parts = split_for_mask_dot(a).reshape(self.chunks, chunk, 3 * a.shape[1])

    @functools.cached_property
    def _factors(self) -> jax.Array:
        """e^{segment sum} of every level's block, `[M, L*C, K]` (every exponent <= 0)."""
        c, levels = self.chunk, self.table.levels
        masks = self.table_ref[pl.ds(KeyMaskTable.SEGMENT * c, levels * c), :]
        return jnp.exp(mask_dot(masks, self._parts))

    def _levels(self):
        """Per level: (factor [M, C, K], pair mask [C, C] bool)."""
        c = self.chunk
        for level in range(self.table.levels):
            pair = self.table_ref[pl.ds((self.table.pair + level) * c, c), :] > 0
            yield self._factors[:, level * c : (level + 1) * c], pair

    def scores(self, x: jax.Array, y: jax.Array) -> jax.Array:
        c = self.chunk
        rows = jax.lax.broadcasted_iota(jnp.int32, (self.chunks, c, c), 1)
        cols = jax.lax.broadcasted_iota(jnp.int32, (self.chunks, c, c), 2)
        diagonal = jnp.sum(x * y, axis=2, keepdims=True)  # [M, C, 1]
        out = jnp.where(rows == cols, diagonal, 0.0)
        for factor, pair in self._levels():
            out = out + jnp.where(pair, dot(x * factor, y * factor, BATCHED_NT, self.dtype), 0.0)
        return out

    def left_right_strict(self, w: jax.Array, y: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        left = jnp.zeros(y.shape, F32)
        right = jnp.zeros(x.shape, F32)
        for factor, pair in self._levels():
            w_level = jnp.where(pair, w, 0.0)  # rows: upper halves only; columns: lower halves only
            left = left + factor * dot(w_level, y * factor, BATCHED_NN, self.dtype)
            right = right + factor * dot(w_level, x * factor, BATCHED_TN, self.dtype)
        return left, right
