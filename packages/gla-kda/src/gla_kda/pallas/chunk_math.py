"""In-kernel building blocks of the kda chunk kernels (plain jnp on VMEM values).

Notation for one chunk of C tokens split into nb = C / s sub-blocks of s rows:
  g [C, K]  per-step log decay (<= 0); G its within-chunk inclusive cumsum.
  A gated product of a row operand a [C, K] and a column operand b [C, K] is
      P_ij = sum_d a_id b_jd exp(G_id - G_jd),   j <= i.
  exp(G_i - G_j) is never formed as exp(G_i) * exp(-G_j) (that overflows for strong decays):
  off-diagonal sub-blocks are anchored at a row n between j and i,
      exp(G_i - G_j) = exp(G_i - G_n) * exp(G_n - G_j),   both exponents <= 0,
  and diagonal sub-blocks loop over one of the s positions, exponentiating masked differences.
  Kernels receive the sub-block-local cumsum L (restarting at every sub-block) instead of G,
  as a compensated float32 pair: every exponent is assembled from L and sub-block totals,
  with differences taken part by part, so its float32 error is relative to its own size (a
  difference of rounded cumsums would lose ~eps * |L|, and |G| reaches |g| * C). See `Decays`.

Nothing here uses cumsum, gathers or jnp.linalg: only matmuls, iota masks, static aligned
slices and reductions, which Mosaic lowers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from gla_core.kit import NUM_SUBLANES, bfloat16_parts
from gla_kda.inputs import log_decay_floor

F32 = jnp.float32
LOG_DECAY_FLOOR = log_decay_floor(F32)


def dot(a, b, dtype, *, trans_a: bool = False, trans_b: bool = False):
    """Matrix product on the MXU with `dtype` operands and float32 accumulation.

    Contracts a's columns (rows when `trans_a`) with b's rows (columns when `trans_b`).
    float32 operands use full float32 precision.
    """
    contract = ((0 if trans_a else 1,), (1 if trans_b else 0,))
    precision = jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == F32 else None
    return jax.lax.dot_general(
        a.astype(dtype),
        b.astype(dtype),
        (contract, ((), ())),
        precision=precision,
        preferred_element_type=F32,
    )


def dot_rows(lefts, b, dtype, *, trans_b: bool = False):
    """`dot(a, b)` for every a of `lefts` (each [R, N]) as one product of their rows stacked, so the
    shared right operand b is loaded into the matrix unit once; returns the list of [R, M] results
    (the same sums, row by row)."""
    rows = lefts[0].shape[0]
    stacked = dot(jnp.concatenate(lefts, axis=0), b, dtype, trans_b=trans_b)
    return [stacked[i * rows : (i + 1) * rows] for i in range(len(lefts))]


def dot_bf16x3(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """`dot` of float32 a, b with float32 results from three bfloat16 products.

    Each operand is split into bfloat16 parts x = x_hi + x_lo (+ ~2^-16 |x|); the products
    hi*hi + lo*hi + hi*lo are exact and accumulate in float32, so the result carries a relative
    error of about 2^-16 (what lo*lo and the rest of the splits would add): the precision the
    bfloat16-input path needs of a float32 intermediate, at half the matrix-unit passes of
    Precision.HIGHEST. Three products rather than one of the parts side by side: the chunk's
    [C, C] operands (C = 64) would be joined at lane offsets that are not multiples of 128.
    Without `trans_a`, hi*hi and lo*hi are one product (`dot_rows`), so b_hi is loaded once.
    """
    bf16 = jnp.bfloat16
    a_hi, b_hi = a.astype(bf16), b.astype(bf16)
    a_lo, b_lo = (a - a_hi.astype(F32)).astype(bf16), (b - b_hi.astype(F32)).astype(bf16)
    product = functools.partial(dot, dtype=bf16, trans_a=trans_a, trans_b=trans_b)
    if trans_a:
        return (product(a_hi, b_hi) + product(a_lo, b_hi)) + product(a_hi, b_lo)
    hi_hi, lo_hi = dot_rows([a_hi, a_lo], b_hi, bf16, trans_b=trans_b)
    return (hi_hi + lo_hi) + product(a_hi, b_lo)


def f32_dot(dtype):
    """The float32 matrix product of a pipeline with `dtype` inputs: Precision.HIGHEST for float32
    inputs, `dot_bf16x3` for bfloat16 inputs."""
    if jnp.dtype(dtype) == F32:
        return functools.partial(dot, dtype=F32)
    return dot_bf16x3


def dot_mask(mask, x, dtype):
    """mask [R, N] bool as 0/1 @ x [N, K] float32, as accurate as `f32_dot(dtype)`: for bfloat16
    inputs the mask is exact in bfloat16, so `dot_bf16x3`'s product of its low part is zero and
    x's two bfloat16 parts go side by side through one product."""
    ones = jnp.where(mask, 1.0, 0.0)
    if jnp.dtype(dtype) == F32:
        return dot(ones, x, F32)
    bf16, width = jnp.bfloat16, x.shape[-1]
    hi = x.astype(bf16)
    sums = dot(ones, jnp.concatenate([hi, (x - hi.astype(F32)).astype(bf16)], axis=-1), bf16)
    return sums[:, :width] + sums[:, width:]


def finite(x):
    """x [..] as float32 with NaN and +-inf replaced by 0 (`gla_kda.nonfinite.zero_nonfinite` in a kernel)."""
    x = x.astype(F32)
    return jnp.where(jnp.abs(x) < jnp.inf, x, 0.0)


def input_f32(x, clean: bool):
    """x [..] as float32: with `clean`, NaN and +-inf read as 0 (`finite`); without, as it is (a
    kernel's first pass over a step its flags then find finite, `poison.StepFlags`)."""
    return finite(x) if clean else x.astype(F32)


def clean_log_decay(g):
    """Per-step log decays g [..] float32 as the chunked forms take them: raised to the float32
    floor (`gla_kda.inputs.floor_log_decay`; -inf becomes the floor), then NaN and +inf zeroed."""
    g = g.astype(F32)
    return jnp.where(g < jnp.inf, jnp.maximum(g, LOG_DECAY_FLOOR), 0.0)  # NaN < inf is false


def floor_log_decay(g):
    """Per-step log decays g [..] raised to the float32 floor only: `clean_log_decay` where g is
    finite or -inf (a kernel's first pass over a step its flags then find finite,
    `poison.StepFlags`)."""
    return jnp.maximum(g.astype(F32), LOG_DECAY_FLOOR)


def clean_log_decay_grad(g, dg):
    """The gradient with respect to raw log decays g [..] float32 of `clean_log_decay` with cotangent
    dg: 0 below the floor, dg elsewhere (zeroing non-finite entries passes the gradient through,
    as `gla_kda.nonfinite.zero_nonfinite`)."""
    return jnp.where(g < LOG_DECAY_FLOOR, 0.0, dg)


def iota(shape, axis: int):
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def lower_mask(n: int, strict: bool):
    """[n, n] bool: j < i (strict) or j <= i."""
    row, col = iota((n, n), 0), iota((n, n), 1)
    return col < row if strict else col <= row


class SubBlocks:
    """Index helpers for a chunk of C rows split into nb sub-blocks of s rows."""

    def __init__(self, chunk: int, sub: int):
        self.chunk, self.sub, self.count = chunk, sub, chunk // sub

    def split(self, x):
        """[C, D] -> [nb, s, D] (tile-aligned, free)."""
        return x.reshape(self.count, self.sub, x.shape[-1])

    def broadcast_row(self, x, position):
        """[C, D] whose row i is x's row at sub-block position `position` of i's sub-block.

        A static `position` is a sublane slice; a traced one (rolled loops) a masked reduction.
        """
        d = x.shape[-1]
        parts = self.split(x)
        if isinstance(position, int):
            row = parts[:, position : position + 1, :]
        else:
            row = jnp.sum(jnp.where(iota(parts.shape, 1) == position, parts, 0.0), axis=1, keepdims=True)
        return jnp.broadcast_to(row, parts.shape).reshape(self.chunk, d)

    def block_sums(self, x):
        """[C, D]: every row replaced by the sum of the rows of its sub-block."""
        d = x.shape[-1]
        sums = jnp.sum(self.split(x), axis=1, keepdims=True)
        return jnp.broadcast_to(sums, (self.count, self.sub, d)).reshape(self.chunk, d)

    def position(self, width: int):
        """[C, width] int32: each row's position inside its sub-block."""
        return iota((self.count, self.sub, width), 1).reshape(self.chunk, width)

    def start(self, width: int):
        """[C, width] int32: the first row of each row's sub-block."""
        return (iota((self.count, self.sub, width), 0) * self.sub).reshape(self.chunk, width)

    def same_block(self):
        """[C, C] bool: row i and column j lie in the same sub-block."""
        start = self.start(self.chunk)
        col = iota((self.chunk, self.chunk), 1)
        return (col >= start) & (col < start + self.sub)

    def rows(self, x, block: int):
        """Rows of sub-block `block` of x, [s, D] (static aligned slice)."""
        return x[block * self.sub : (block + 1) * self.sub]

    def stack(self, blocks, width: int):
        """[C, width] from per-sub-block row slabs; None slabs are zeros."""
        slabs = [jnp.zeros((self.sub, width), F32) if b is None else b for b in blocks]
        return slabs[0] if len(slabs) == 1 else jnp.concatenate(slabs, axis=0)


def _grid_scale(sub: int) -> float:
    """2^f for the grid 2^-f on which sums over a sub-block of cleaned log decays (|x| <= 104,
    |sum| < 2^b, b the bits of s * 104) are exact in float32: f = 23 - b (one bit spare)."""
    bits = int(sub * -LOG_DECAY_FLOOR).bit_length()
    return 2.0 ** (23 - bits)


def _on_grid(x, scale: float):
    """x [..] float32 truncated toward zero to a multiple of 1 / scale (a power of two), exactly.

    Through int32 (|x| * scale < 2^31): (x + R) - R would round the same way, but compilers
    fold it to x.
    """
    return (x * scale).astype(jnp.int32).astype(F32) * (1.0 / scale)


def split_on_grid(g, sub: int):
    """(coarse, fine), g = coarse + fine exactly, for cleaned log decays g [..] float32: coarse on
    a grid whose float32 sums over s = `sub` steps are exact (`_grid_scale`), |fine| below
    one grid step."""
    coarse = _on_grid(g, _grid_scale(sub))
    return coarse, g - coarse


def _rows_scan(x, sub: int):
    """Inclusive float32 prefix sums of x [R, K] along rows within sub-blocks of `sub` rows (R and
    `sub` multiples of 8).

    Each (8, K) tile is scanned on its own (Hillis-Steele over its sublanes: one sublane rotation,
    `pltpu.roll` as `jnp.roll`, and one masked add per level, the mask shared by every tile); the
    tiles of a sub-block then add the totals of the tiles before them, each a broadcast of a tile's
    last row.
    """
    rows, width = x.shape
    tiles = x.reshape(rows // NUM_SUBLANES, NUM_SUBLANES, width)
    sublane = iota((1, NUM_SUBLANES, width), 1)
    shift = 1
    while shift < min(sub, NUM_SUBLANES):
        tiles = tiles + jnp.where(sublane >= shift, pltpu.roll(tiles, shift, 1), 0.0)
        shift *= 2
    per_block = sub // NUM_SUBLANES
    if per_block > 1:
        blocks = tiles.reshape(rows // sub, per_block, NUM_SUBLANES, width)
        scanned, carry = [blocks[:, 0]], blocks[:, 0, NUM_SUBLANES - 1 :]
        for j in range(1, per_block):
            scanned.append(blocks[:, j] + carry)
            carry = scanned[-1][:, NUM_SUBLANES - 1 :]
        tiles = jnp.stack(scanned, axis=1)
    return tiles.reshape(rows, width)


def local_cumsum(g, sb: SubBlocks, compensated: bool = True):
    """Inclusive cumsum of g [R, K] (cleaned log decays, R a multiple of s) along rows, restarting every sub-block.

    Returns (hi, lo): with `compensated`, both [R, K] float32, the cumsum as the unevaluated
    sum hi + lo that `Decays` expects: g is split into a part on a grid whose sums are exact
    in float32 (hi; grid 2^-12 for s = 16, `split_on_grid`) and the rest, less than a grid
    step, whose float32 sums err by ~2^-24 of that (lo). Otherwise (hi, None), hi the rounded
    float32 cumsum.
    """
    if not compensated:
        return _rows_scan(g, sb.sub), None
    coarse, fine = split_on_grid(g, sb.sub)
    return _rows_scan(coarse, sb.sub), _rows_scan(fine, sb.sub)


class Decays:
    """Every decay exponent a kernel needs, from the sub-block-local cumsum L [C, K] of g.

    L restarts at every sub-block and arrives as an unevaluated float32 sum L = hi + lo
    (compensated summation, `local_cumsum`): hi is L rounded to float32, lo the rounding
    error. Sums of same-sign terms are accurate relative to themselves from hi alone. A
    difference L_i - L_j is formed as (hi_i - hi_j) + (lo_i - lo_j): accurate relative to itself,
    where hi alone would carry an absolute error of eps * |L| (after a few steps of decay -20, an
    error of 1e-5 in a decay exp(L_i - L_j) of order 1; |L| reaches 1664 = s * 104 at the floor).
    With tau_b the total of sub-block b (L at its last row) and blk(i) the sub-block of row i:
      cum       G_i            = sum_{c < blk(i)} tau_c + L_i
      to_end    G_last - G_i   = (tau_blk(i) - L_i) + sum_{c > blk(i)} tau_c
      total     G_last         = sum_c tau_c                                  [1, K]
    Exponents are all <= 0. Without lo (`local_cumsum` uncompensated), `cum`, `to_end` and `total`
    come from hi alone: to_end's difference then errs by up to 4 eps (|tau| + |L|) (four rounded
    additions per scanned sum), a relative error in exp(to_end) of at most 4e-4 (half a
    sub-block at the floor decay, the rest near 0) and about 2e-5 where |L| < 40: below the
    bfloat16 rounding (2e-3) of the matrix-unit operand it scales (`KernelConfig.compensated_decays`).
    The other differences (`before_anchor`, `within_block`, `from_position`) need lo.
    """

    def __init__(self, hi, sb: SubBlocks, lo=None):
        self.hi, self.lo, self.sb = hi, lo, sb
        last = [(b + 1) * sb.sub - 1 for b in range(sb.count)]
        self.totals = [hi[i : i + 1] + (0.0 if lo is None else lo[i : i + 1]) for i in last]
        self._totals_parts = [(hi[i : i + 1], None if lo is None else lo[i : i + 1]) for i in last]

    @classmethod
    def of_steps(cls, g, sb: SubBlocks, compensated: bool = True, clean: bool = True):
        """The decays of one chunk from its raw per-step log decays g [C, K] (any float dtype,
        possibly non-finite or below the floor: cleaned by `clean_log_decay`; without `clean`, only
        raised to the floor, the same for finite g); without `compensated`, no low part
        (`local_cumsum`): `cum`, `to_end` and `total` from hi alone."""
        steps = clean_log_decay(g) if clean else floor_log_decay(g)
        hi, lo = local_cumsum(steps, sb, compensated)
        return cls(hi, sb, lo)

    def _difference(self, x_hi, x_lo, y_hi, y_lo):
        """(x - y) from the unevaluated sums x = x_hi + x_lo and y = y_hi + y_lo."""
        if self.lo is None:
            raise ValueError("Decays: differences of the cumsum need its low part (lo)")
        return (x_hi - y_hi) + (x_lo - y_lo)

    def _sum(self, first: int, last: int):
        """sum_{c = first..last} tau_c as [1, K] (zeros when empty)."""
        acc = jnp.zeros_like(self.totals[0])
        for c in range(first, last + 1):
            acc = acc + self.totals[c]
        return acc

    @functools.cached_property
    def _prefix_sums(self):
        """[1, K] sum_{c < b} tau_c for b = 0..nb, each from the one before (one add per sub-block)."""
        sums = [jnp.zeros_like(self.totals[0])]
        for tau in self.totals:
            sums.append(sums[-1] + tau)
        return sums

    @functools.cached_property
    def _suffix_sums(self):
        """[1, K] sum_{c > b} tau_c for b = 0..nb-1, each from the one after it."""
        sums = [jnp.zeros_like(self.totals[0])]
        for tau in reversed(self.totals[1:]):
            sums.append(tau + sums[-1])
        return sums[::-1]

    def per_block(self, rows):
        """[C, K] from one [1, K] row (or None for zeros) per sub-block, broadcast over its s rows."""
        k = self.hi.shape[1]
        slabs = [None if r is None else jnp.broadcast_to(r, (self.sb.sub, k)) for r in rows]
        return self.sb.stack(slabs, k)

    @functools.cached_property
    def to_block_end(self):
        """[C, K] G_end(blk(i)) - G_i = tau_blk(i) - L_i."""
        his, los = zip(*self._totals_parts, strict=True)
        if self.lo is None:
            return self.per_block(his) - self.hi
        return self._difference(self.per_block(his), self.per_block(los), self.hi, self.lo)

    @functools.cached_property
    def cum(self):
        """[C, K] G_i."""
        local = self.hi if self.lo is None else self.hi + self.lo
        return self.per_block(self._prefix_sums[:-1]) + local

    @functools.cached_property
    def to_end(self):
        """[C, K] G_last - G_i."""
        after = self.per_block(self._suffix_sums)
        return self.to_block_end + after

    @functools.cached_property
    def total(self):
        """[1, K] G_last."""
        return self._prefix_sums[-1]

    def before_anchor(self, r: int):
        """[C, K] G_n - G_j for rows j < n = r * s (first row of sub-block r); 0 on rows >= n."""
        n = r * self.sb.sub
        first = self.hi[n : n + 1] + self.lo[n : n + 1]
        slabs = []
        for b in range(self.sb.count):
            if b < r:
                slabs.append(self.sb.rows(self.to_block_end, b) + self._sum(b + 1, r - 1) + first)
            else:
                slabs.append(None)
        return self.sb.stack(slabs, self.hi.shape[1])

    def within_block(self, r: int):
        """[s, K] G_i - G_n for the rows of sub-block r (n its first row)."""
        n = r * self.sb.sub
        rows = self.sb.rows
        return self._difference(rows(self.hi, r), rows(self.lo, r), self.hi[n : n + 1], self.lo[n : n + 1])

    @functools.cached_property
    def from_middle(self):
        """[C, K] G_i - G_m, m the middle row of i's sub-block (exponents of either sign)."""
        return self.from_position(self.sb.sub // 2)

    def from_position(self, jj):
        """[C, K] G_i - G_m, m the row at position jj of row i's sub-block (meaningful where i >= m)."""
        row = self.sb.broadcast_row
        return self._difference(self.hi, self.lo, row(self.hi, jj), row(self.lo, jj))

    def gate_grad(self, after, before, after_block, before_block, dtype=F32):
        """The gradient [C, K] with respect to the per-step log decays g of the chunk.

        Every argument is [C, K] float32, each term entering only the steps its exponent sums:
          dg_u = sum_{t >= u} after_t + sum_{t < u} before_t
                 + sum_{t >= u in u's sub-block} after_block_t + sum_{t < u in u's sub-block} before_block_t
        (G_t sums the decays up to t; G_last - G_t those after t; and the same inside a sub-block).
        The steps t of u's own sub-block take one float32 triangular matmul (`dot_mask` of inputs of
        `dtype`) of [after + after_block; before + before_block] against the two masks side by side;
        the whole sub-blocks after (before) u's add their column sums of `after` (`before`). Every
        term is summed once: nothing is formed as a difference of sums.
        """
        sb, c = self.sb, self.sb.chunk
        u, j = iota((c, 2 * c), 0), iota((c, 2 * c), 1)
        second = j >= c  # columns c.. take the `before` terms
        t = jnp.where(second, j - c, j)
        start = sb.start(2 * c)
        in_block = (t >= start) & (t < start + sb.sub)
        inside = dot_mask(
            in_block & ((second & (t < u)) | (~second & (t >= u))),
            jnp.concatenate([after + after_block, before + before_block], axis=0),
            dtype,
        )
        if sb.count == 1:
            return inside
        after_sums = [jnp.sum(sb.rows(after, b), axis=0, keepdims=True) for b in range(sb.count)]
        before_sums = [jnp.sum(sb.rows(before, b), axis=0, keepdims=True) for b in range(sb.count)]
        outside = [functools.reduce(jnp.add, after_sums[b + 1 :] + before_sums[:b]) for b in range(sb.count)]
        return inside + self.per_block(outside)


def position_loop(count: int, body, carry, unroll: bool):
    """Loop over sub-block positions: unrolled with static positions (TPU), or `lax.fori_loop`.

    Rolled loops keep interpret-mode programs small to compile; both compute the same values.
    """
    if not unroll:
        return jax.lax.fori_loop(0, count, body, carry)
    for position in range(count):
        carry = body(position, carry)
    return carry


def unit_lower_inverse(a, sb: SubBlocks, unroll: bool, dtype=F32):
    """(I + A)^-1 for a strictly lower-triangular A [C, C] float32 (`unit_lower_inverses` of one)."""
    return unit_lower_inverses([a], sb, unroll, dtype)[0]


def _block_of(index, size: int):
    """index // size for int32 indices >= 0 (a truncating division: `//` lowers through sign)."""
    return jax.lax.div(index, jnp.int32(size))


def select_parts_exact(parts, selection):
    """x @ selection for x [M, N] float32 given as its three bfloat16 parts (hi, mid, lo)
    (`gla_core.chunk.common.bfloat16_parts`, x == hi + mid + lo) and selection [N, P] (bool) with
    at most one True per output term (every output element copies one element of x, or is 0).

    One product of the parts side by side along the contraction: each output element sums one
    exact term per part in float32, hi first, and hi + mid and then + lo are exact. (Added in
    another order, a sum could round once: an error of one float32 ulp.)"""
    ones = jnp.where(selection, 1.0, 0.0).astype(jnp.bfloat16)
    return dot(jnp.concatenate(parts, axis=1), jnp.concatenate([ones] * len(parts), axis=0), jnp.bfloat16)


def select_exact(x, selection):
    """`select_parts_exact` of float32 x [M, N]."""
    return select_parts_exact(bfloat16_parts(x), selection)


class PackedBlocks:
    """The s x s diagonal blocks of [C, C] matrices packed side by side into [s, C]: block b's
    row i, column j sits at row i, lane b * s + j. Row-wise work on the blocks then touches C / s
    times fewer vector registers than on the [C, C] matrix."""

    def __init__(self, sb: SubBlocks):
        self.sb = sb
        lane = iota((sb.sub, sb.chunk), 1)
        self.block = _block_of(lane, sb.sub)  # [s, C]: the block of each lane
        self.column = lane - self.block * sb.sub  # [s, C]: the column inside its block

    def pack(self, a):
        """[C, C] -> [s, C]: the diagonal blocks of a (static aligned row slices and selects)."""
        sb = self.sb
        packed = jnp.zeros((sb.sub, sb.chunk), F32)
        for b in range(sb.count):
            packed = jnp.where(self.block == b, sb.rows(a, b), packed)
        return packed

    def unpack(self, packed):
        """[s, C] -> [C, C] block diagonal, zero off the diagonal blocks."""
        return self.sb.stack([jnp.where(self.block == b, packed, 0.0) for b in range(self.sb.count)], self.sb.chunk)

    def column_broadcasts(self, packed_mats):
        """For each packed matrix P and column p < s - 1: [s, C] whose lanes of block b all hold
        column p of block b (B_p[i, b*s + q] = P[i, b*s + p]), as one [(s-1) s, C] array per
        matrix (rows p*s..(p+1)*s for column p). One exact selection product for all matrices,
        of their bfloat16 parts split once and masked column by column."""
        s, zero = self.sb.sub, jnp.zeros((), jnp.bfloat16)
        parts = [bfloat16_parts(m) for m in packed_mats]
        columns = [
            jnp.concatenate([jnp.where(self.column == p, m[part], zero) for m in parts for p in range(s - 1)], axis=0)
            for part in range(3)
        ]
        spread = select_parts_exact(columns, self.sb.same_block())
        rows = (s - 1) * s
        return [spread[i * rows : (i + 1) * rows] for i in range(len(packed_mats))]


def _pick_rows(x, position, rows: int):
    """Rows position*rows..(position+1)*rows of x: a static slice, or a masked sum when
    `position` is traced (rolled loops)."""
    if isinstance(position, int):
        return x[position * rows : (position + 1) * rows]
    parts = x.reshape(x.shape[0] // rows, rows, x.shape[-1])
    return jnp.sum(jnp.where(iota(parts.shape, 0) == position, parts, 0.0), axis=0)


def unit_lower_inverses(mats, sb: SubBlocks, unroll: bool, dtype=F32):
    """(I + A)^-1 for each strictly lower-triangular A [C, C] float32, by recursive blocking.

    The s x s diagonal blocks, packed side by side (`PackedBlocks`), are eliminated row by row
    on the vector unit, giving D = (I + A)^-1 on the block diagonal: once row p of every block
    is final, A_ip times it leaves the rows i below it. The columns A_ip come from A alone, so
    they are spread over their blocks' lanes before the loop, off its dependency chain.
    Then blocks of w = s, 2s, 4s, ... rows are joined in pairs: with A_w the part of A in the
    lower-left w x w quadrant of every 2w block,
      D <- D - D (A_w D)
    is the inverse on the 2w blocks ([[D1, 0], [-D2 A21 D1, D2]]), two float32 products per
    level (`f32_dot` of inputs of `dtype`), ceil(log2(C / s)) levels. Only the lower halves of
    the 2w blocks change, so both products take those C / 2 rows alone (`_lower_halves`).
    Each stage runs over every matrix before the next one starts, so the matrices' dependency
    chains interleave.
    """
    c, s = sb.chunk, sb.sub
    mm = f32_dot(dtype)
    blocks = PackedBlocks(sb)
    spread = blocks.column_broadcasts([blocks.pack(a) for a in mats])

    def eliminate(p, inv_blocks):
        return [
            inv - _pick_rows(cols, p, s) * jnp.broadcast_to(_pick_rows(inv, p, 1), inv.shape)
            for inv, cols in zip(inv_blocks, spread, strict=True)
        ]

    identity = (iota((s, c), 0) == blocks.column).astype(F32)
    inverses = [blocks.unpack(d) for d in position_loop(s - 1, eliminate, [identity for _ in mats], unroll)]
    row, col = iota((c, c), 0), iota((c, c), 1)
    width = s
    while width < c:
        same_pair = _block_of(row, 2 * width) == _block_of(col, 2 * width)
        quadrant = _lower_halves(same_pair & (_block_of(row, width) != _block_of(col, width)), width)
        # X = A_w D on the lower halves' rows (the only rows where A_w is not zero), [about C/2, C].
        coupled = [
            mm(jnp.where(quadrant, _lower_halves(a, width), 0.0), d) for a, d in zip(mats, inverses, strict=True)
        ]
        joined = []
        for d, x in zip(inverses, coupled, strict=True):
            lower = _lower_halves(d, width)
            upper = _upper_halves(d, width)
            lower = lower - mm(lower, _join_halves(jnp.zeros_like(upper), x, width))  # -D2 (A21 D1) beside D2
            joined.append(_join_halves(upper, lower, width))
        inverses = joined
        width *= 2
    return inverses


def _halves(rows: int, width: int):
    """(upper, lower) row ranges of every 2*width-row block of `rows` rows (the last block may be
    short: its lower half partly or wholly past the end)."""
    return [
        ((start, min(start + width, rows)), (min(start + width, rows), min(start + 2 * width, rows)))
        for start in range(0, rows, 2 * width)
    ]


def _stack_rows(x, ranges):
    return jnp.concatenate([x[first:last] for first, last in ranges if last > first], axis=0)


def _upper_halves(x, width: int):
    """x [R, N]: the first `width` rows of every 2*width-row block, stacked (aligned slices)."""
    return _stack_rows(x, [upper for upper, _ in _halves(x.shape[0], width)])


def _lower_halves(x, width: int):
    """x [R, N]: the last `width` rows of every 2*width-row block, stacked."""
    return _stack_rows(x, [lower for _, lower in _halves(x.shape[0], width)])


def _join_halves(upper, lower, width: int):
    """The inverse of (`_upper_halves`, `_lower_halves`): [R, N] from their stacked rows."""
    slabs, used = [], [0, 0]
    for ranges in _halves(upper.shape[0] + lower.shape[0], width):
        for side, (part, (first, last)) in enumerate(zip((upper, lower), ranges, strict=True)):
            if last > first:
                slabs.append(part[used[side] : used[side] + last - first])
                used[side] += last - first
    return jnp.concatenate(slabs, axis=0)


def unit_lower_inverse_flops(c: int, s: int) -> int:
    """Flops of `unit_lower_inverses` for one [C, C] matrix: the elimination of the s x s diagonal
    blocks and two [C/2, C] x [C, C] products per level of joined blocks."""
    levels = (c // s - 1).bit_length()
    return 2 * c * c * s + levels * 2 * (2 * (c // 2) * c * c)
