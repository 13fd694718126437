"""In-kernel building blocks of the kda chunk kernels (plain jnp on VMEM values).

Notation for one chunk of C tokens split into nb = C / s sub-blocks of s rows:
  g [C, K]  per-step log decay (<= 0); G its within-chunk inclusive cumsum.
  A gated product of a row operand a [C, K] and a column operand b [C, K] is
      P_ij = sum_d a_id b_jd exp(G_id - G_jd),   j <= i.
  exp(G_i - G_j) is never formed as exp(G_i) * exp(-G_j) (that overflows for strong decays):
  off-diagonal sub-blocks are anchored at a row n between j and i,
      exp(G_i - G_j) = exp(G_i - G_n) * exp(G_n - G_j),   both exponents <= 0,
  and diagonal sub-blocks loop over one of the s positions, exponentiating masked differences.
  Kernels receive the sub-block-local cumsum L (restarting at every sub-block) instead of G:
  every exponent is assembled from L and sub-block totals, sums of same-sign terms, so its
  float32 error is relative to its own size plus at most one sub-block's total (a difference
  of chunk-level cumsums would lose ~eps * |G| and |G| reaches |g| * C). See `Decays`.

Nothing here uses cumsum, gathers or jnp.linalg: only matmuls, iota masks, static aligned
slices and reductions, which Mosaic lowers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gla_core.chunk.common import column_to_row, row_to_column  # noqa: F401  (the kda kernels use cm.*)

F32 = jnp.float32


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


def iota(shape, axis: int):
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def eye_mask(n: int):
    """[n, n] bool identity."""
    return iota((n, n), 0) == iota((n, n), 1)


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


class Decays:
    """Every decay exponent a kernel needs, from the sub-block-local cumsum L [C, K] (float32).

    With tau_b the total of sub-block b (L at its last row) and blk(i) the sub-block of row i:
      cum       G_i            = sum_{c < blk(i)} tau_c + L_i
      to_end    G_last - G_i   = (tau_blk(i) - L_i) + sum_{c > blk(i)} tau_c
      total     G_last         = sum_c tau_c                                  [1, K]
    Exponents are all <= 0.
    """

    def __init__(self, local, sb: SubBlocks):
        self.local, self.sb = local, sb
        self.totals = [local[(b + 1) * sb.sub - 1 : (b + 1) * sb.sub] for b in range(sb.count)]

    def _sum(self, first: int, last: int):
        """sum_{c = first..last} tau_c as [1, K] (zeros when empty)."""
        acc = jnp.zeros_like(self.totals[0])
        for c in range(first, last + 1):
            acc = acc + self.totals[c]
        return acc

    def _per_block(self, rows):
        """[C, K] from one [1, K] row (or None for zeros) per sub-block, broadcast over its s rows."""
        k = self.local.shape[1]
        slabs = [None if r is None else jnp.broadcast_to(r, (self.sb.sub, k)) for r in rows]
        return self.sb.stack(slabs, k)

    @functools.cached_property
    def to_block_end(self):
        """[C, K] G_end(blk(i)) - G_i = tau_blk(i) - L_i."""
        return self._per_block(self.totals) - self.local

    @functools.cached_property
    def cum(self):
        """[C, K] G_i."""
        return self._per_block([self._sum(0, b - 1) for b in range(self.sb.count)]) + self.local

    @functools.cached_property
    def to_end(self):
        """[C, K] G_last - G_i."""
        after = self._per_block([self._sum(b + 1, self.sb.count - 1) for b in range(self.sb.count)])
        return self.to_block_end + after

    @functools.cached_property
    def total(self):
        """[1, K] G_last."""
        return self._sum(0, self.sb.count - 1)

    def before_anchor(self, r: int):
        """[C, K] G_n - G_j for rows j < n = r * s (first row of sub-block r); 0 on rows >= n."""
        n = r * self.sb.sub
        first = self.local[n : n + 1]
        slabs = []
        for b in range(self.sb.count):
            if b < r:
                slabs.append(self.sb.rows(self.to_block_end, b) + self._sum(b + 1, r - 1) + first)
            else:
                slabs.append(None)
        return self.sb.stack(slabs, self.local.shape[1])

    def after_block(self, cb: int):
        """[C - (cb + 1) s, K] G_i - G_m for the rows i after sub-block cb (m its last row)."""
        slabs = [self.sb.rows(self.local, b) + self._sum(cb + 1, b - 1) for b in range(cb + 1, self.sb.count)]
        return slabs[0] if len(slabs) == 1 else jnp.concatenate(slabs, axis=0)

    def within_block(self, r: int):
        """[s, K] G_i - G_n for the rows of sub-block r (n its first row)."""
        n = r * self.sb.sub
        return self.sb.rows(self.local, r) - self.local[n : n + 1]


def _masked_exp(diff, keep):
    """exp(diff) where `keep`, 1 elsewhere (the difference there may be large and positive)."""
    return jnp.exp(jnp.where(keep, diff, 0.0))


def _loop(count: int, body, carry, unroll: bool):
    """Loop over sub-block positions: unrolled with static positions (TPU), or `lax.fori_loop`.

    Rolled loops keep interpret-mode programs small to compile; both compute the same values.
    """
    if not unroll:
        return jax.lax.fori_loop(0, count, body, carry)
    for position in range(count):
        carry = body(position, carry)
    return carry


def gated_scores(rows_ops, col_op, decays: Decays, dtype, unroll: bool):
    """P[a]_ij = sum_d a_id b_jd exp(G_id - G_jd) for j <= i, zero above the diagonal.

    Args:
      rows_ops: row operands a, each [C, K] float32.
      col_op: the shared column operand b [C, K] float32.
      decays: the chunk's decay exponents.
      dtype: matrix-unit operand dtype of the off-diagonal products.
      unroll: unroll the loop over sub-block positions.

    Returns:
      One [C, C] float32 per row operand.
    """
    sb, g = decays.sb, decays.local
    c = sb.chunk
    col = iota((c, c), 1)
    # Off-diagonal sub-blocks: rows of block r against columns < n = r * s, anchored at row n.
    off = [[None] for _ in rows_ops]
    for r in range(1, sb.count):
        n = r * sb.sub
        b_anchored = col_op * jnp.exp(decays.before_anchor(r))
        decay_rows = jnp.exp(decays.within_block(r))
        for slabs, a in zip(off, rows_ops, strict=True):
            block = dot(sb.rows(a, r) * decay_rows, b_anchored, dtype, trans_b=True)
            slabs.append(jnp.where(col[:1] < n, block, 0.0))
    scores = tuple(sb.stack(slabs, c) for slabs in off)
    position, start = sb.position(g.shape[1]), sb.start(c)

    # Diagonal sub-blocks: column position jj of every sub-block at a time.
    def column(jj, scores):
        decay = _masked_exp(g - sb.broadcast_row(g, jj), position >= jj)
        b_decayed = sb.broadcast_row(col_op, jj) * decay
        target = col == start + jj
        columns = [jnp.sum(a * b_decayed, axis=1, keepdims=True) for a in rows_ops]
        return tuple(jnp.where(target, x, p) for p, x in zip(scores, columns, strict=True))

    scores = _loop(sb.sub, column, scores, unroll)
    causal = lower_mask(c, strict=False)
    return [jnp.where(causal, p, 0.0) for p in scores]


def gated_rows(weights, col_op, decays: Decays, dtype, unroll: bool):
    """R[P]_i = sum_{j <= i} P_ij b_j exp(G_i - G_j), for lower-triangular weights P [C, C].

    The row-operand gradient of `gated_scores`: with dP the cotangent of P, da = R[dP].
    Returns one [C, K] float32 per weight matrix (entries of P above the diagonal must be 0).
    """
    sb, g = decays.sb, decays.local
    c, k = sb.chunk, col_op.shape[1]
    col = iota((c, c), 1)
    off = [[None] for _ in weights]
    for r in range(1, sb.count):
        n = r * sb.sub
        b_anchored = col_op * jnp.exp(decays.before_anchor(r))
        decay_rows = jnp.exp(decays.within_block(r))
        for slabs, p in zip(off, weights, strict=True):
            before = jnp.where(col[: sb.sub] < n, sb.rows(p, r), 0.0)
            slabs.append(decay_rows * dot(before, b_anchored, dtype))
    result = tuple(sb.stack(slabs, k) for slabs in off)
    position, start = sb.position(k), sb.start(c)

    def column(jj, result):
        decay = _masked_exp(g - sb.broadcast_row(g, jj), position >= jj)
        b_decayed = sb.broadcast_row(col_op, jj) * decay
        target = col == start + jj
        return tuple(
            acc + jnp.sum(jnp.where(target, p, 0.0), axis=1, keepdims=True) * b_decayed
            for acc, p in zip(result, weights, strict=True)
        )

    return list(_loop(sb.sub, column, result, unroll))


def gated_cols(pairs, decays: Decays, dtype, unroll: bool):
    """Q[P, a]_j = sum_{i >= j} P_ij a_i exp(G_i - G_j), for lower-triangular P [C, C].

    The column-operand gradient of `gated_scores`: with dP the cotangent of P[a], db = Q[dP, a].
    Args: pairs of (P [C, C], a [C, K]). Returns one [C, K] float32 per pair.
    """
    sb, g = decays.sb, decays.local
    c, k = sb.chunk, g.shape[1]
    off = [[] for _ in pairs]
    # Columns of block cb against the rows after it, anchored at the block's last row.
    for cb in range(sb.count - 1):
        after = (cb + 1) * sb.sub
        decay_rows = jnp.exp(decays.after_block(cb))
        decay_cols = jnp.exp(sb.rows(decays.to_block_end, cb))
        for slabs, (p, a) in zip(off, pairs, strict=True):
            full = dot(p[after:], a[after:] * decay_rows, dtype, trans_a=True)
            slabs.append(decay_cols * sb.rows(full, cb))
    result = tuple(sb.stack([*slabs, None], k) for slabs in off)
    position = sb.position(k)
    eye = eye_mask(c)

    def row(ii, result):
        decay = _masked_exp(sb.broadcast_row(g, ii) - g, position <= ii)
        return tuple(
            acc
            + jnp.sum(jnp.where(eye, sb.broadcast_row(p, ii), 0.0), axis=1, keepdims=True)
            * sb.broadcast_row(a, ii)
            * decay
            for acc, (p, a) in zip(result, pairs, strict=True)
        )

    return list(_loop(sb.sub, row, result, unroll))


def unit_lower_inverse(a, sb: SubBlocks, unroll: bool):
    """(I + A)^-1 for a strictly lower-triangular A [C, C] float32, by blocked forward substitution.

    Diagonal s x s blocks are eliminated row by row on the vector unit (all blocks at once),
    then block rows are solved in order: T_b = T_bb (E_b - A_b,<b T_<b).
    """
    c = sb.chunk
    a_diag = jnp.where(sb.same_block(), a, 0.0)
    a_off = a - a_diag
    identity = eye_mask(c).astype(F32)
    start = sb.start(c)
    col = iota((c, c), 1)

    # Right-looking elimination: once row p of every block is final, remove it from the rows below.
    def eliminate(p, inv_diag):
        a_col = jnp.sum(jnp.where(col == start + p, a_diag, 0.0), axis=1, keepdims=True)
        return inv_diag - a_col * sb.broadcast_row(inv_diag, p)

    inv_diag = _loop(sb.sub - 1, eliminate, identity, unroll)
    slabs = [sb.rows(inv_diag, r) for r in range(sb.count)]
    for r in range(1, sb.count):
        current = jnp.concatenate(slabs, axis=0)
        rhs = sb.rows(identity, r) - dot(sb.rows(a_off, r), current, F32)
        padded = sb.stack([rhs if b == r else None for b in range(sb.count)], c)
        slabs[r] = dot(sb.rows(inv_diag, r), padded, F32)
    return slabs[0] if sb.count == 1 else jnp.concatenate(slabs, axis=0)
