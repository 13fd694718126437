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
masks it before `exp`. `KeyGate` (a decay per key, gla) cannot build [C, C, K], so it splits
the pairs t > s by the highest bit where t and s differ: at level l both lie in one block
of 2^(l+1) steps, t in its upper half and s in its lower half, and with r the last step of
the lower half `e^{b_t - b_s} = e^{b_t - b_r} e^{b_r - b_s}`, both factors <= 0 and both
exponents segment sums. Every row lies in one half at each level, so a level takes one
segment-sum matmul and one `exp` for the factors of all rows, and one masked MXU matmul per product.

Hard resets (a log decay of -inf, decay exactly 0) reach the kernels floored at `GATE_FLOOR`
(`floor_gates`), see there. Products whose factors are masked to zero use `jnp.where`, never a
multiplication by a 0/1 mask, so a non-finite q, k or v stays in the rows it belongs to.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gla_core.chunk.common import (
    NN,
    NT,
    TN,
    chunk_iota,
    column_to_row,
    dot,
    mask_dot,
    row_to_column,
    split_for_mask_dot,
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


class KeyGate:
    """Per-key per-step log decays of one chunk, `a` `[C, K]` (float32).

    Quantities are computed when first used, so a kernel traces only what it needs.
    """

    def __init__(self, a: jax.Array, dtype):
        chunk = a.shape[0]
        if chunk & (chunk - 1):
            raise ValueError(f"chunk size must be a power of two, got {chunk}")
        self.dtype = dtype
        self.chunk = chunk
        self.a = a

    @functools.cached_property
    def split(self) -> jax.Array:
        """The gate as `mask_dot` takes it: its three bfloat16 parts side by side, [C, 3K]."""
        return split_for_mask_dot(self.a)

    def from_start(self) -> jax.Array:
        rows, cols = chunk_iota(self.chunk)
        return jnp.exp(mask_dot(cols <= rows, self.split))  # e^{b_t}, [C, K]

    def to_end(self) -> jax.Array:
        rows, cols = chunk_iota(self.chunk)
        return jnp.exp(mask_dot(cols > rows, self.split))  # e^{b_L - b_t}, [C, K]

    def last_decay(self) -> jax.Array:
        return jnp.exp(jnp.sum(self.a, axis=0, keepdims=True))  # [1, K]

    def _levels(self):
        """Per level: (e^{b_t - b_r} for upper-half rows [C,K], e^{b_r - b_s} for lower-half rows
        [C,K], pair mask [C,C]); zero on the rows of the other half.

        A row is in the upper or the lower half of its block, never both, so one masked matmul
        gives every row's segment sum and one `exp` its factor."""
        chunk = self.chunk
        rows, cols = chunk_iota(chunk)
        level = 0
        while (1 << level) < chunk:
            upper_row = ((rows >> level) & 1) == 1  # [C, C], constant along a row
            anchor = ((rows >> (level + 1)) << (level + 1)) + (1 << level) - 1  # r of each row's block
            # upper rows: sum over r < u <= t; lower rows: sum over s < u <= r
            segment = (upper_row & (cols > anchor) & (cols <= rows)) | (~upper_row & (cols > rows) & (cols <= anchor))
            factor = jnp.exp(mask_dot(segment, self.split))  # every exponent <= 0
            is_upper = upper_row[:, :1]
            upper = jnp.where(is_upper, factor, 0.0)
            lower = jnp.where(is_upper, 0.0, factor)
            pair = (
                ((rows >> (level + 1)) == (cols >> (level + 1)))
                & (((rows >> level) & 1) == 1)
                & (((cols >> level) & 1) == 0)
            )
            yield upper, lower, pair
            level += 1

    def scores(self, x: jax.Array, y: jax.Array) -> jax.Array:
        x = x.astype(F32)
        y = y.astype(F32)
        rows, cols = chunk_iota(self.chunk)
        diagonal = jnp.sum(x * y, axis=1, keepdims=True)  # [C, 1]
        out = jnp.where(rows == cols, diagonal, 0.0)
        for upper, lower, pair in self._levels():
            out = out + jnp.where(pair, dot(x * upper, y * lower, NT, self.dtype), 0.0)
        return out

    def left_right_strict(self, w: jax.Array, y: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = x.astype(F32)
        y = y.astype(F32)
        left = jnp.zeros(y.shape, F32)
        right = jnp.zeros(x.shape, F32)
        for upper, lower, pair in self._levels():
            w_level = jnp.where(pair, w, 0.0)
            left = left + upper * dot(w_level, y * lower, NN, self.dtype)
            right = right + lower * dot(w_level, x * upper, TN, self.dtype)
        return left, right

    def gate_grad(self, after: jax.Array, before: jax.Array, total: jax.Array) -> jax.Array:
        """d loss / d a `[C, K]`: `sum_{t>=u} after_t + sum_{s<u} before_s + total` (triangular matmuls)."""
        rows, cols = chunk_iota(self.chunk)
        da = mask_dot(cols >= rows, after) + mask_dot(cols < rows, before) + total
        return jnp.where(self.a <= GATE_FLOOR, 0.0, da)


def intra_costs(mode: str, chunk: int, keys: int, products: int) -> tuple[int, int]:
    """(flops, transcendentals) of one chunk's gate with `products` gated [C, C] x [C, K] products."""
    product = 2 * chunk * chunk * keys
    if mode == "scalar":
        return 4 * chunk * chunk + 2 * chunk**3 + products * product, chunk * chunk + 3 * chunk
    levels = max(chunk.bit_length() - 1, 0) if products else 0
    # Every segment-sum matmul (`mask_dot`) is three bfloat16 products: two for the decays from the
    # start and to the end, one per level, each level with one exp per element.
    return 3 * (2 + levels) * product + levels * products * product, chunk * keys * (2 + levels)


def make_gate(mode: str, block: jax.Array, dtype) -> ScalarGate | KeyGate:
    """The gate of one chunk from its loaded block: "scalar" `[1, C]` or "key" `[C, K]`."""
    return ScalarGate(block, dtype) if mode == "scalar" else KeyGate(block, dtype)
