"""In-kernel decay of one chunk: the overflow-safe, cancellation-free gated products.

The gate arrives as the raw per-step log decays `a_u` of the chunk (float32, <= 0 for
decays). Every exponent is a segment sum `sum_{s<u<=t} a_u` computed directly as a masked
float32-accurate matmul (a triangular matmul, no cumsum op; `common.mask_dot` for per-key
gates), never as the difference of two long cumulative sums: with a decay of -10 per step a
cumulative sum reaches -1280 in a chunk of 128, and the difference of two such numbers keeps
only ~1e-4 absolute precision, while a segment sum is exact to float32 relative precision of
itself. With b_t = sum_{u<=t} a_u
and L the last step of the chunk, every exponential has an argument <= 0:

  from_start  e^{b_t}            decay from the chunk start through step t   (q side)
  to_end      e^{b_L - b_t}      decay after step t to the chunk end          (k side)
  last_decay  e^{b_L}            decay over the whole chunk                   (state)

and the intra-chunk products over pairs t >= s:

  scores(x, y)      M_ts   = sum_k x_tk y_sk e^{b_tk - b_sk}           [C, C], zero for s > t
  left_right_strict(w, y, x), for w strictly lower triangular (the diagonal has exponent 0
  and is left to the caller):
                    left_t  = sum_{s<t} w_ts y_s e^{b_t - b_s}         [C, K]
                    right_s = sum_{t>s} w_ts x_t e^{b_t - b_s}         [C, K]

`ScalarGate` (one decay per step, simple_gla) builds the [C, C] segment-sum matrix and
masks it before `exp`. A decay per key (gla) cannot build [C, C, K]: its kernels take all
chunks of a grid step at once, with the decays of `anchored.StepDecays` and the products of
`products` (anchored, or exact by levels), from the constant masks of `KeyMaskTable` here.

Hard resets (a log decay of -inf, decay exactly 0) reach the kernels floored at `GATE_FLOOR`
(`floor_gates`), see there. Products whose factors are masked to zero use `jnp.where`, never a
multiplication by a 0/1 mask, so a non-finite q, k or v stays in the rows it belongs to.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from gla_core.chunk.common import (
    NN,
    NT,
    TN,
    chunk_iota,
    column_to_row,
    dot,
    row_to_column,
)

F32 = jnp.float32

# The smallest log decay the kernels see; -inf (a hard reset) and anything below are floored to it.
# Segment sums are masked matmuls, which multiply every gate of the chunk by a 0/1 mask entry:
# 0 * -inf = NaN would reach every segment sum of the chunk. Flooring keeps the semantics exact:
# e^{-1e30} is exactly 0 in float32 (everything below -104 underflows), a segment sum of up to
# 128 floored steps (-1.3e32) is far from the float32 limit (-3.4e38) and, plus any finite gates
# of size < 1e29, still underflows to exactly 0, so every decay through a floored step is exactly
# 0 as with -inf. The gradient with respect to a floored gate is set to exactly 0 (`gate_grad`),
# the derivative of e^{a} at a = -inf (and of the floor itself).
GATE_FLOOR = -1e30


def floor_gates(a: jax.Array) -> jax.Array:
    """Log decays with -inf (and anything below `GATE_FLOOR`) raised to `GATE_FLOOR`; NaN stays NaN."""
    return jnp.maximum(a, GATE_FLOOR)


def _mask(condition: jax.Array) -> jax.Array:
    return condition.astype(F32)


class ChunkMasks:
    """The iota comparisons `[C, C]` of a chunk (t the row, s the column) that `ScalarGate` uses.

    They depend on C alone, so a kernel that walks several chunks per grid iteration builds one
    `ChunkMasks` and shares it between the chunks' gates: each mask is traced once, when first
    used. Float masks are 0/1 matrices for triangular matmuls.
    """

    def __init__(self, chunk: int):
        self.chunk = chunk

    @functools.cached_property
    def _iota(self):
        return chunk_iota(self.chunk)

    @functools.cached_property
    def diagonal(self) -> jax.Array:
        rows, cols = self._iota
        return rows == cols

    @functools.cached_property
    def causal(self) -> jax.Array:
        """t >= s (bool)."""
        rows, cols = self._iota
        return rows >= cols

    @functools.cached_property
    def lower(self) -> jax.Array:
        """[t >= s] (float)."""
        return _mask(self.causal)

    @functools.cached_property
    def strict_lower(self) -> jax.Array:
        """[t > s] (float)."""
        rows, cols = self._iota
        return _mask(rows > cols)

    @functools.cached_property
    def upper(self) -> jax.Array:
        """[t <= s] (float)."""
        rows, cols = self._iota
        return _mask(rows <= cols)

    @functools.cached_property
    def strict_upper(self) -> jax.Array:
        """[t < s] (float)."""
        rows, cols = self._iota
        return _mask(rows < cols)

    def row_to_column(self, row: jax.Array) -> jax.Array:
        """`common.row_to_column` with this chunk's diagonal."""
        return row_to_column(row, self.diagonal)

    def column_to_row(self, col: jax.Array) -> jax.Array:
        """`common.column_to_row` with this chunk's diagonal."""
        return column_to_row(col, self.diagonal)


class ScalarGate:
    """Scalar per-step log decays of one chunk, `a` as a row `[1, C]` (float32).

    Quantities are computed when first used, so a kernel traces only what it needs. `masks`
    shares the chunk's iota masks between gates (built here when not given).
    """

    def __init__(self, a_row: jax.Array, dtype, masks: ChunkMasks | None = None):
        self.dtype = dtype
        self.chunk = a_row.shape[1]
        self.a_row = a_row
        if masks is not None and masks.chunk != self.chunk:
            raise ValueError(f"masks: built for chunk {masks.chunk}, the gate has chunk {self.chunk}")
        self.masks = masks if masks is not None else ChunkMasks(self.chunk)

    @functools.cached_property
    def decay(self) -> jax.Array:
        """e^{b_t - b_s} for t >= s, else 0: [C, C]."""
        m = self.masks
        # segment[t, s] = sum_u [s < u <= t] a_u
        segment = dot(jnp.where(m.causal, self.a_row, 0.0), m.strict_lower, NN, F32)
        return jnp.where(m.causal, jnp.exp(jnp.where(m.causal, segment, 0.0)), 0.0)

    def from_start(self) -> jax.Array:
        through = dot(self.a_row, self.masks.upper, NN, F32)  # b_t = sum_{u<=t} a_u, [1, C]
        return jnp.exp(self.masks.row_to_column(through))  # [C, 1]

    def to_end(self) -> jax.Array:
        after = dot(self.a_row, self.masks.strict_lower, NN, F32)  # b_L - b_t = sum_{u>t} a_u, [1, C]
        return jnp.exp(self.masks.row_to_column(after))  # [C, 1]

    def last_decay(self) -> jax.Array:
        return jnp.exp(jnp.sum(self.a_row, axis=1, keepdims=True))  # [1, 1]

    def scores(self, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.where(self.masks.causal, dot(x, y, NT, self.dtype), 0.0) * self.decay

    def left_right_strict(self, w: jax.Array, y: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        wd = w * self.decay
        return dot(wd, y, NN, self.dtype), dot(wd, x, TN, self.dtype)

    def gate_grad(self, after: jax.Array, before: jax.Array, total: jax.Array) -> jax.Array:
        """d loss / d a as a row `[1, C]`: `sum_{t>=u} after_t + sum_{s<u} before_s + total`, with
        `after`, `before` `[C, K]` and `total` `[1, K]` summed over keys (triangular matmuls)."""
        m = self.masks
        after_row = m.column_to_row(jnp.sum(after, axis=1, keepdims=True))
        before_row = m.column_to_row(jnp.sum(before, axis=1, keepdims=True))
        da = dot(after_row, m.lower, NN, F32) + dot(before_row, m.strict_upper, NN, F32)
        return jnp.where(self.a_row <= GATE_FLOOR, 0.0, da + jnp.sum(total))


class KeyMaskTable:
    """The constant 0/1 masks `[C, C]` of the per-key gate, stacked into one bfloat16 array.

    The masks depend on C alone. Built inside a kernel from iotas they cost more vector work
    than the products they select, so the launcher passes them once as an input (a block with
    a constant index, fetched once) and `KeyGate` slices it. Blocks of C rows, in order (the
    first 3 are the segment sums of the anchored products of `anchored.StepDecays`, one matmul
    together; blocks 1 .. 2 + L those of every decay `KeyGate`'s level products need, one
    matmul together):

      ANCHOR        [t, u] = +1 for m < u <= t, -1 for t < u <= m (m = C/2 - 1, the anchor row):
                             D_t = b_t - b_m                                    (anchored products)
      THROUGH       [t, u] = u <= t          b_t = sum_{u<=t} a_u               (from_start)
      AFTER         [t, u] = u > t           b_L - b_t = sum_{u>t} a_u          (to_end)
      SEGMENT + l   [t, u] = r < u <= t for a row t in the upper half of its block at level l,
                             t < u <= r in the lower half (r the last step of the lower half)
      PAIR + l      [t, s] = t in the upper half, s in the lower half of one block at level l
      FROM_U_ON     [u, t] = t >= u          sum_{t>=u} (gate gradient)
      BEFORE_U      [u, s] = s < u           sum_{s<u}  (gate gradient)
      SUB_ANCHOR    [t, u] = ANCHOR inside each sub-block of `sub_block` steps, anchored at the
                             sub-block's middle row m(t):  b_t - b_m(t)        (blocked products)
    """

    ANCHOR, THROUGH, AFTER, SEGMENT = range(4)
    # Steps per sub-block of the blocked products (`products.BlockedProducts`): 16 keeps every
    # sub-block exponent within the bfloat16 anchor range for per-step decays up to ~3.7.
    SUB_BLOCK = 16

    def __init__(self, chunk: int):
        if chunk < 1 or chunk & (chunk - 1):
            raise ValueError(f"chunk size must be a power of two, got {chunk}")
        self.chunk = chunk
        self.levels = chunk.bit_length() - 1

    @property
    def pair(self) -> int:
        """The block index of PAIR + 0."""
        return self.SEGMENT + self.levels

    @property
    def from_u_on(self) -> int:
        return self.SEGMENT + 2 * self.levels

    @property
    def before_u(self) -> int:
        return self.from_u_on + 1

    @property
    def sub_anchor(self) -> int:
        return self.before_u + 1

    @property
    def sub_block(self) -> int:
        """s, the steps of a sub-block of the blocked products (the whole chunk when it is shorter)."""
        return min(self.SUB_BLOCK, self.chunk)

    @property
    def shape(self) -> tuple[int, int]:
        return ((self.sub_anchor + 1) * self.chunk, self.chunk)

    @property
    def anchor_row(self) -> int:
        """m, the row the anchored products are anchored at (the middle of the chunk)."""
        return max(self.chunk // 2 - 1, 0)

    def build(self) -> jax.Array:
        """The table, bfloat16 `shape` (exact 0 / +-1 values)."""
        rows, cols = np.indices((self.chunk, self.chunk))
        blocks = [_signed_segments_to(np.full_like(rows, self.anchor_row), rows, cols), cols <= rows, cols > rows]
        pairs = []
        for level in range(self.levels):
            upper_row = ((rows >> level) & 1) == 1
            anchor = ((rows >> (level + 1)) << (level + 1)) + (1 << level) - 1
            upper = upper_row & (cols > anchor) & (cols <= rows)
            lower = ~upper_row & (cols > rows) & (cols <= anchor)
            blocks.append(upper | lower)
            same_block = (rows >> (level + 1)) == (cols >> (level + 1))
            pairs.append(same_block & upper_row & (((cols >> level) & 1) == 0))
        gradient_sums = [cols >= rows, cols < rows]
        s = self.sub_block
        sub_anchor = _signed_segments_to((rows // s) * s + max(s // 2 - 1, 0), rows, cols)
        stacked = [np.asarray(block, np.float32) for block in blocks + pairs + gradient_sums + [sub_anchor]]
        return jnp.asarray(np.concatenate(stacked, axis=0), jnp.bfloat16)

    def block_spec(self) -> pl.BlockSpec:
        """The whole table in every grid step (the index never changes, so it is fetched once)."""
        return pl.BlockSpec(self.shape, lambda *indices: (0, 0))


def _signed_segments_to(anchors: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """[t, u] = +1 for m < u <= t, -1 for t < u <= m, with m = anchors[t, u] the row t's anchor:
    the mask whose product with the per-step log decays is b_t - b_m."""
    later = (rows > anchors) & (cols > anchors) & (cols <= rows)
    earlier = (rows < anchors) & (cols > rows) & (cols <= anchors)
    return np.where(later, 1.0, 0.0) - np.where(earlier, 1.0, 0.0)


def intra_costs(mode: str, chunk: int, keys: int, products: int, anchored: bool = False) -> tuple[int, int]:
    """(flops, transcendentals) of one chunk's gate with `products` gated [C, C] x [C, K] products;
    `anchored`: a per-key gate's products are anchored (`anchored.StepDecays`), not level products."""
    product = 2 * chunk * chunk * keys
    if mode == "scalar":
        return 4 * chunk * chunk + 2 * chunk**3 + products * product, chunk * chunk + 3 * chunk
    # Every segment-sum matmul (`mask_dot`) is three bfloat16 products, each with one exp per element.
    if products and anchored:  # blocks ANCHOR, THROUGH, AFTER; e^{D} and e^{-D}; one matmul per product
        return 3 * 3 * product + products * product, chunk * keys * 4
    levels = max(chunk.bit_length() - 1, 0) if products else 0  # THROUGH, AFTER and one block per level
    return 3 * (2 + levels) * product + levels * products * product, chunk * keys * (2 + levels)


def mask_table_inputs(mode: str, chunk: int) -> tuple[list[jax.Array], list[pl.BlockSpec]]:
    """The extra kernel input of a gate mode and its block spec: the `KeyMaskTable` for "key" and
    "broadcast", nothing for "scalar"."""
    if mode == "scalar":
        return [], []
    table = KeyMaskTable(chunk)
    return [table.build()], [table.block_spec()]
