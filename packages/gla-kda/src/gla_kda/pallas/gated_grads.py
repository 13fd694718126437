"""Gradients of the gated intra-chunk products, in a kernel (plain jnp on VMEM values).

For cotangents W [C, C] (zero above the diagonal) of P[a]_ij = sum_d a_id b_jd exp(G_id - G_jd)
(j <= i, notation of `chunk_math`): the row operand's gradient, the column operand's, and the
gradient with respect to the per-step log decays, each term summed only over the steps its
exponent spans (no difference of separately rounded sums that cancel: see `intra_bwd`).

Off-diagonal sub-blocks (rows of block r, columns before it) are matrix products anchored at the
first row of block r, every exponent <= 0. The s x s diagonal sub-blocks take one of two forms:
  anchored (the fast path): with D_t = G_t - G_m, m the middle row of t's sub-block,
      exp(G_i - G_j) = exp(D_i) exp(-D_j)
    makes each product one block-diagonal matrix product. Used when every |D| of the grid step is
    within the anchor range (as gla-core's anchored products; the kernel recomputes a step out of
    range with the exact form); the exponents are clipped to it,
    so nothing overflows whatever the decays. The gate gradient of a pair j < i of one sub-block
    reaches the steps j < u <= i: summed over t >= u, (row sums of M)_t - (column sums of M)_t
    leaves exactly those pairs. Both sums take every pair's term from the same rounded operands
    (the matrix unit's products of them are exact), so what cancels is the same number on both
    sides, up to float32 accumulation over at most s terms.
  exact: a loop over the s positions of the sub-block on the vector unit, every exponent a masked
    difference <= 0, the gate gradient accumulated pair by pair.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gla_core.kit import all_within
from gla_kda.pallas.chunk_math import F32, Decays, dot, dot_rows, iota, position_loop


@dataclasses.dataclass(frozen=True)
class GatedGrads:
    """Gradients of the gated products P[a]_ij = sum_d a_id b_jd exp(G_id - G_jd) (j <= i) for cotangents W.

    rows: one [C, K] per product, sum_{j <= i} W_ij b_j exp(G_i - G_j) (times a: the row operand's gradient).
    cols: one [C, K] per product, sum_{i >= j} W_ij a_i exp(G_i - G_j) (times b: the column operand's).
    Gate gradient of all products together, in the parts `Decays.gate_grad` sums: with
    M_ij = W_ij a_i b_j exp(G_i - G_j), every pair j < u <= i reaches the per-step decay g_u:
      after_block [C, K]: summed over the steps t >= u of u's sub-block: M summed over the columns
        of earlier sub-blocks, for the row t; plus, for the anchored diagonal sub-blocks, the row
        sums minus the column sums of M inside t's sub-block;
      before_block [C, K]: M summed over the rows of later sub-blocks, for the columns of the
        column's sub-block before u;
      direct [C, K]: the pairs whose sub-blocks lie on both sides of u's sub-block, and, for the
        exact diagonal sub-blocks, the pairs inside one sub-block.
    """

    rows: list
    cols: list
    after_block: jax.Array
    before_block: jax.Array
    direct: jax.Array


@dataclasses.dataclass(frozen=True)
class _Diagonal:
    """The diagonal sub-blocks' part of `GatedGrads`: rows, cols (one [C, K] per product), after_block, direct."""

    rows: list
    cols: list
    after_block: jax.Array
    direct: jax.Array


def gated_grads(pairs, col_op, decays: Decays, dtype, unroll: bool, anchor_range: float | None) -> GatedGrads:
    """Row, column and gate gradients of gated products sharing the column operand b.

    Args:
      pairs: (W, a) per product: W [C, C] the cotangent of P (zero above the diagonal), a [C, K]
        the row operand (float32).
      col_op: the column operand b [C, K] float32.
      decays: the chunk's decay exponents.
      dtype: matrix-unit operand dtype of the products.
      unroll: unroll the exact loop over sub-block positions.
      anchor_range: the anchored diagonal sub-blocks' largest |D|, or None for the exact loop. The
        exponents are clipped to it: a chunk out of range (`diagonals_in_range`) must be recomputed
        without it.

    Returns:
      `GatedGrads`.
    """
    sb, k = decays.sb, col_op.shape[1]
    rows_off = [[None] for _ in pairs]
    # Column-side sums per sub-block of columns: off-diagonal block r reaches the columns j < r * s only.
    col_slabs = [[None] * sb.count for _ in pairs]
    after_off = [None]
    between = [jnp.zeros((1, k), F32) for _ in range(sb.count)]
    # Off-diagonal sub-blocks: rows of block r against the columns j < n = r * s, anchored at row n.
    for r in range(1, sb.count):
        n = r * sb.sub
        col_decay = jnp.exp(decays.before_anchor(r)[:n])  # exp(G_n - G_j), [n, K]
        b_anchored = col_op[:n] * col_decay
        decay_rows = jnp.exp(decays.within_block(r))
        after = jnp.zeros((sb.sub, k), F32)
        column_terms = jnp.zeros((n, k), F32)
        befores = [sb.rows(w, r)[:, :n] for w, _ in pairs]  # [s, n] each
        by_column = dot_rows(befores, b_anchored, dtype)  # against the shared column operand
        for index, ((_, a), before, product) in enumerate(zip(pairs, befores, by_column, strict=True)):
            row_grad = decay_rows * product
            rows_off[index].append(row_grad)
            after = after + sb.rows(a, r) * row_grad
            # sum_{i in block r} W_ij a_i exp(G_i - G_n) for the columns j < n, [n, K].
            from_block = dot(before, sb.rows(a, r) * decay_rows, dtype, trans_a=True)
            reached = col_decay * from_block
            for b in range(r):
                slab = sb.rows(reached, b)
                col_slabs[index][b] = slab if col_slabs[index][b] is None else col_slabs[index][b] + slab
            column_terms = column_terms + b_anchored * from_block
        after_off.append(after)
        # Pairs (i in block r, j before block c) straddle every step of a block c strictly between.
        for between_block in range(1, r):
            between[between_block] = between[between_block] + jnp.sum(
                column_terms[: between_block * sb.sub], axis=0, keepdims=True
            )
    cols_off = [sb.stack(slabs, k) for slabs in col_slabs]
    before_block = col_op * sum(cols_off)  # rows of later sub-blocks only

    diagonal = _diagonal_grads(pairs, col_op, decays, dtype, unroll, anchor_range)
    return GatedGrads(
        rows=[sb.stack(slabs, k) + diag for slabs, diag in zip(rows_off, diagonal.rows, strict=True)],
        cols=[off + diag for off, diag in zip(cols_off, diagonal.cols, strict=True)],
        after_block=sb.stack(after_off, k) + diagonal.after_block,
        before_block=before_block,
        direct=decays.per_block(between) + diagonal.direct,
    )


def _diagonal_grads(pairs, col_op, decays: Decays, dtype, unroll: bool, anchor_range: float | None) -> _Diagonal:
    if anchor_range is None:
        return _diagonal_exact(pairs, col_op, decays, unroll)
    clipped = jnp.clip(decays.from_middle, -anchor_range, anchor_range)
    return _diagonal_anchored(pairs, col_op, decays, clipped, dtype)


def diagonals_in_range(decays: Decays, anchor_range: float):
    """Whether every |D| of the chunk (`Decays.from_middle`) is within `anchor_range` (a scalar bool; False for NaN)."""
    return all_within(decays.from_middle, anchor_range)


def _diagonal_anchored(pairs, col_op, decays: Decays, exponents, dtype) -> _Diagonal:
    """The diagonal sub-blocks from the anchored factors exp(+-D) of `exponents` D [C, K] (|D| <= the range)."""
    sb = decays.sb
    c = sb.chunk
    row, col = iota((c, c), 0), iota((c, c), 1)
    strict = sb.same_block() & (col < row)
    up, down = jnp.exp(exponents), jnp.exp(-exponents)

    def rounded(x):
        """x as the matrix unit reads it (the gate gradient's pairs take their terms from these)."""
        return x.astype(dtype).astype(F32)

    b_down = rounded(col_op * down)
    rows, cols = [], []
    after_block = jnp.zeros(col_op.shape, F32)
    w_stricts = [jnp.where(strict, w, 0.0) for w, _ in pairs]
    all_row_sums = dot_rows(w_stricts, b_down, dtype)  # sum_{j < i} W_ij b_j exp(-D_j) of every product
    for (w, a), w_strict, row_sums in zip(pairs, w_stricts, all_row_sums, strict=True):
        a_up = rounded(a * up)
        w_diagonal = jnp.sum(jnp.where(col == row, w, 0.0), axis=1, keepdims=True)  # W_ii, exponent 0
        col_sums = dot(w_strict, a_up, dtype, trans_a=True)  # sum_{i > j} W_ij a_i exp(D_i)
        rows.append(up * row_sums + w_diagonal * col_op)
        cols.append(down * col_sums + w_diagonal * a)
        after_block = after_block + (a_up * row_sums - b_down * col_sums)
    return _Diagonal(rows=rows, cols=cols, after_block=after_block, direct=jnp.zeros(col_op.shape, F32))


def _masked_exp(diff, keep):
    """exp(diff) where `keep`, 1 elsewhere (the difference there may be large and positive)."""
    return jnp.exp(jnp.where(keep, diff, 0.0))


def _diagonal_exact(pairs, col_op, decays: Decays, unroll: bool) -> _Diagonal:
    """The diagonal sub-blocks by a loop over column positions jj, every sub-block at a time, in increasing order."""
    sb = decays.sb
    c, k = sb.chunk, col_op.shape[1]
    col = iota((c, c), 1)
    position, start = sb.position(k), sb.start(c)

    def column(jj, carry):
        rows, cols, reached, direct = carry
        decay = _masked_exp(decays.from_position(jj), position >= jj)
        b_col = sb.broadcast_row(col_op, jj)
        target = col == start + jj
        b_decayed = b_col * decay
        new_rows, new_cols = [], []
        for acc_row, acc_col, (w, a) in zip(rows, cols, pairs, strict=True):
            w_col = jnp.sum(jnp.where(target, w, 0.0), axis=1, keepdims=True)  # W_i,jj
            new_rows.append(acc_row + w_col * b_decayed)
            weighted = w_col * a * decay
            new_cols.append(acc_col + jnp.where(position == jj, sb.block_sums(weighted), 0.0))
            reached = reached + weighted * b_col  # sum over the columns <= jj of M_ij
        # Steps u = jj + 1: pairs j <= jj < u <= i inside the sub-block.
        later = sb.block_sums(jnp.where(position > jj, reached, 0.0))
        direct = direct + jnp.where(position == jj + 1, later, 0.0)
        return new_rows, new_cols, reached, direct

    zeros = jnp.zeros((c, k), F32)
    per_pair = [zeros for _ in pairs]
    rows, cols, _, direct = position_loop(sb.sub, column, (per_pair, per_pair, zeros, zeros), unroll)
    return _Diagonal(rows=rows, cols=cols, after_block=zeros, direct=direct)
