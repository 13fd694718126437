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
`BlockedProducts`: between the two, for decays too strong to anchor a whole chunk at one row: the
level products for pairs in different sub-blocks of `KeyMaskTable.sub_block` steps, anchored
products inside each sub-block; valid where every sub-block is within the anchor range.
`recompute_products` picks the blocked or the level products for a step out of the anchor range.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_core.chunk.anchored import StepDecays, all_within
from gla_core.chunk.batched import causal_mask
from gla_core.chunk.common import BATCHED_NN, BATCHED_NT, BATCHED_TN, dot, mask_dot, split_for_mask_dot
from gla_core.chunk.gates import KeyMaskTable
from gla_core.errors import InvalidArgumentError

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
        return _add_level_scores(jnp.where(rows == cols, diagonal, 0.0), x, y, self._levels(), self.dtype)

    def left_right_strict(self, w: jax.Array, y: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        zeros = (jnp.zeros(y.shape, F32), jnp.zeros(x.shape, F32))
        return _add_level_left_right(zeros, w, y, x, self._levels(), self.dtype)


def _add_level_scores(out: jax.Array, x: jax.Array, y: jax.Array, levels, dtype) -> jax.Array:
    """`out` plus the scores of every level's pairs; `levels` yields (factor [M, C, K], pair mask [C, C])."""
    for factor, pair in levels:
        out = out + jnp.where(pair, dot(x * factor, y * factor, BATCHED_NT, dtype), 0.0)
    return out


def _add_level_left_right(left_right, w: jax.Array, y: jax.Array, x: jax.Array, levels, dtype):
    """(left, right) = `left_right` plus every level's strictly lower left/right products."""
    left, right = left_right
    for factor, pair in levels:
        w_level = jnp.where(pair, w, 0.0)  # rows: upper halves only; columns: lower halves only
        left = left + factor * dot(w_level, y * factor, BATCHED_NN, dtype)
        right = right + factor * dot(w_level, x * factor, BATCHED_TN, dtype)
    return left, right


class BlockedProducts:
    """The gated products exact between sub-blocks and anchored inside them, batched over the leading axis.

    With s = `KeyMaskTable.sub_block`, a pair t > s' in different sub-blocks meets at a level l with
    2^(l+1) > s and takes that level's exact factors (`LevelProducts`); a pair inside one sub-block
    takes the anchored factors e^{D'_t} e^{-D'_s'}, D'_t = b_t - b_m(t) with m(t) the middle row of
    t's sub-block (`KeyMaskTable.SUB_ANCHOR`), clipped to the anchor range before `exp` so nothing
    overflows. log2(C/s) + 1 products where `LevelProducts` takes log2(C), and `in_range` holds for
    per-step decays C/s times stronger than the chunk-wide anchored products allow.

    Args:
      a: `[M*C, K]` float32 per-step log decays (floored); table_ref: the call's `KeyMaskTable` ref.
      chunk: C; anchor_range: the largest |D'| of the anchored sub-blocks (> 0); dtype: the
        matrix-unit dtype.
    """

    def __init__(self, a: jax.Array, table_ref, chunk: int, anchor_range: float, dtype):
        if anchor_range <= 0:
            raise InvalidArgumentError(f"anchor_range: expected a positive range, got {anchor_range}")
        table = KeyMaskTable(chunk)
        self.chunk, self.anchor_range, self.dtype = chunk, anchor_range, dtype
        self.sub = table.sub_block
        self.chunks = a.shape[0] // chunk
        first = self.sub.bit_length() - 1  # the lowest level whose pairs lie in different sub-blocks
        self.levels = range(first, table.levels)
        c = chunk
        masks = [table_ref[pl.ds(table.sub_anchor * c, c), :]]
        if len(self.levels):
            masks.append(table_ref[pl.ds((KeyMaskTable.SEGMENT + first) * c, len(self.levels) * c), :])
        self.pairs = [table_ref[pl.ds((table.pair + level) * c, c), :] > 0 for level in self.levels]
        parts = split_for_mask_dot(a).reshape(self.chunks, c, 3 * a.shape[1])
        sums = mask_dot(jnp.concatenate(masks, axis=0), parts)  # [M, (1 + levels) C, K]
        self._sub_anchored = sums[:, :c]
        self._level_sums = sums[:, c:]

    @functools.cached_property
    def in_range(self) -> jax.Array:
        """Whether every |D'| of the step is <= the anchor range (a scalar bool; False where a gate is NaN)."""
        return all_within(self._sub_anchored, self.anchor_range)

    @functools.cached_property
    def _anchored(self) -> tuple[jax.Array, jax.Array]:
        """(e^{D'}, e^{-D'}) [M, C, K], the exponents clipped to the anchor range."""
        clipped = jnp.clip(self._sub_anchored, -self.anchor_range, self.anchor_range)
        return jnp.exp(clipped), jnp.exp(-clipped)

    @functools.cached_property
    def _level_factors(self) -> jax.Array:
        return jnp.exp(self._level_sums)

    def _levels(self):
        """Per level above the sub-block: (factor [M, C, K], pair mask [C, C] bool)."""
        c = self.chunk
        for index, pair in enumerate(self.pairs):
            yield self._level_factors[:, index * c : (index + 1) * c], pair

    def _same_sub_block(self, strict: bool) -> jax.Array:
        """[C, C] bool: s' <= t (s' < t when strict) in one sub-block."""
        rows = jax.lax.broadcasted_iota(jnp.int32, (self.chunk, self.chunk), 0)
        cols = jax.lax.broadcasted_iota(jnp.int32, (self.chunk, self.chunk), 1)
        causal = cols < rows if strict else cols <= rows
        shift = self.sub.bit_length() - 1  # s is a power of two (no integer division on the vector unit)
        return causal & ((rows >> shift) == (cols >> shift))

    def scores(self, x: jax.Array, y: jax.Array) -> jax.Array:
        up, down = self._anchored
        inside = dot(x * up, y * down, BATCHED_NT, self.dtype)
        out = jnp.where(self._same_sub_block(strict=False), inside, 0.0)
        return _add_level_scores(out, x, y, self._levels(), self.dtype)

    def left_right_strict(self, w: jax.Array, y: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        up, down = self._anchored
        w_inside = jnp.where(self._same_sub_block(strict=True), w, 0.0)
        left = up * dot(w_inside, y * down, BATCHED_NN, self.dtype)
        right = down * dot(w_inside, x * up, BATCHED_TN, self.dtype)
        return _add_level_left_right((left, right), w, y, x, self._levels(), self.dtype)


def recompute_products(a: jax.Array, table_ref, chunk: int, anchor_range: float, dtype, write) -> None:
    """The recompute of a step out of the chunk-wide anchor range: calls `write(products)` under
    `pl.when` with `BlockedProducts` where the step is within their range, else with `LevelProducts`.

    Args: a `[M*C, K]` float32 log decays (floored); table_ref: the call's `KeyMaskTable` ref.
    """
    blocked = BlockedProducts(a, table_ref, chunk, anchor_range, dtype)
    pl.when(blocked.in_range)(lambda: write(blocked))
    pl.when(jnp.logical_not(blocked.in_range))(lambda: write(LevelProducts(a, table_ref, chunk, dtype)))
