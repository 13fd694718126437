"""Intra-chunk decayed attention scores and their gradients, for scalar and per-key decays.

Within one chunk of C steps with per-step log decays g (<= 0):

    A[i, j] = Σ_d q[i, d] k[j, d] exp(Σ_{j < s <= i} g[s, d])    for j <= i, else 0.

Every exponent is a sum of decays over a range of steps, formed from that range's own terms:
the difference b_i - b_j of cumulative decays is the same number, but in float32 it carries
an absolute error of ~1e-7 |b_i|, which matters (≈1e-5 relative) when the cumulative decay
is large and the pair is close, and it is lost entirely after a hard reset (a gate clamped at
`numerics.LOG_DECAY_FLOOR`).

Scalar decay (simple_gla, g [..., C, 1]): the exponent factors out of the sum over d, so
A = (q kᵀ) ∘ D with D = exp(segment sums of g), masked — one GEMM, C² exponentials.

Per-key decay (gla, g [..., C, K]) needs the exponent per key. Splitting it as
exp(x_i) exp(y_j) keeps both factors <= 1 only when the split point lies between j and i, so
the chunk is cut into sub-chunks of c steps. Rows of sub-chunk s see the columns of earlier
sub-chunks split at the step before s: row factor exp(Σ_{start(s) <= t <= i} g_t), column factor
exp(Σ_{j < t < start(s)} g_t) (one GEMM per row block); the c×c diagonal blocks are computed
exactly, elementwise over the key dimension, from segment sums.

Entries above the diagonal are selected away with `jnp.where`, never multiplied by a zero mask:
a nan or inf in k or v at step j must not reach the rows i < j (outputs before step j).

The diagonal A[i, i] = q_i · k_i does not depend on g. The gradient with respect to the
cumulative decay b (d b_i = Σ_j M_ij - Σ_j M_ji with M = dA ∘ A) is formed from the strictly
lower part only: the diagonal terms cancel in exact arithmetic but not in float32, where they
are O(1) while the true gradient under strong decay is tiny.

All inputs share one float dtype (float32, or float64) with leading batch dims `...` (chunks,
batch, heads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gla_simple.numerics import (
    chunk_cumsum,
    einsum,
    lower_triangle,
    masked_exp,
    reverse_chunk_cumsum,
    segment_sums,
)

SUB_CHUNK = 16


def is_scalar_gate(g: jax.Array) -> bool:
    return g.shape[-1] == 1


# --------------------------------------------------------------------------- scalar decay


def _scalar_decay(g: jax.Array) -> jax.Array:
    """[..., C, C] exp(Σ_{j < s <= i} g_s) for j <= i, else 0, from g [..., C, 1]."""
    chunk = g.shape[-2]
    return masked_exp(lower_triangle(chunk), segment_sums(g[..., 0]))


def _scalar_scores(q, k, g):
    causal = lower_triangle(q.shape[-2])
    return jnp.where(causal, einsum("...ik,...jk->...ij", q, k) * _scalar_decay(g), 0.0)


def _scalar_score_grads(d_scores, q, k, g, scores):
    weighted = jnp.where(lower_triangle(q.shape[-2]), d_scores * _scalar_decay(g), 0.0)
    dq = einsum("...ij,...jk->...ik", weighted, k)
    dk = einsum("...ij,...ik->...jk", weighted, q)
    off_diagonal = jnp.where(lower_triangle(q.shape[-2], strict=True), d_scores * scores, 0.0)
    d_b = jnp.sum(off_diagonal, axis=-1) - jnp.sum(off_diagonal, axis=-2)
    return dq, dk, d_b[..., None]


# --------------------------------------------------------------------------- per-key decay
#
# Arrays of this path are kept at rank <= 5 by folding every leading dim (and the sub-chunk
# index of the diagonal blocks) into one axis: XLA:CPU in jax 0.10.2 can crash on rank-7
# multiply-reduce fusions with a size-1 dimension (jax-ml/jax#40412).


def _sub_chunk(chunk: int) -> int:
    return min(SUB_CHUNK, chunk)


def _earlier_columns(chunk: int, size: int) -> jax.Array:
    """[S, C, 1] bool: column j lies in a sub-chunk before sub-chunk s."""
    count = chunk // size
    return (jnp.arange(chunk)[None, :] < size * jnp.arange(count)[:, None])[..., None]


def _vector_factors(g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Decay factors of the per-key path for g [M, C, K], each exponent a sum of decays (<= 0).

    Returns:
      row: [M, S, c, K] exp(Σ_{start(s) <= t <= i} g_t) for step i of sub-chunk s.
      column: [M, S, C, K] exp(Σ_{j < t < start(s)} g_t) for steps j before sub-chunk s, else 0.
      within: [M*S, c, c, K] exp(Σ_{j < t <= i} g_t) for steps j < i of sub-chunk s, else 0.
    """
    rows, chunk, keys = g.shape
    size = _sub_chunk(chunk)
    count = chunk // size
    blocks = g.reshape(rows, count, size, keys)
    local = chunk_cumsum(blocks)  # Σ from the block start to t, [M, S, c, K]
    rest = reverse_chunk_cumsum(blocks, exclusive=True)  # Σ after t to the block end
    block = jnp.arange(count)
    strictly_between = (block[None, :, None] < block[None, None, :]) & (block[None, None, :] < block[:, None, None])
    between = einsum("stu,muk->mstk", strictly_between.astype(g.dtype), local[:, :, -1, :])  # [M, S, S', K]
    row = jnp.exp(local)
    earlier = (block[None, :] < block[:, None])[:, :, None, None]  # [S, S', 1, 1]
    column = masked_exp(earlier, rest[:, None, :, :, :] + between[:, :, :, None, :])  # [M, S, S', c, K]
    column = column.reshape(rows, count, chunk, keys)
    per_key = jnp.swapaxes(blocks.reshape(rows * count, size, keys), -1, -2)  # [M*S, K, c]
    pair_sums = jnp.moveaxis(segment_sums(per_key), 1, -1)  # Σ_{j < t <= i} g_t, [M*S, c, c, K]
    within = masked_exp(lower_triangle(size, strict=True)[:, :, None], pair_sums)
    return row, column, within


def _block_diagonal(x: jax.Array, rows: int) -> jax.Array:
    """[M*S, c, c] diagonal blocks -> [M, S*c, S*c] block-diagonal matrices."""
    size = x.shape[-1]
    count = x.shape[0] // rows
    same_block = jnp.eye(count, dtype=bool)[None, :, None, :, None]
    full = jnp.where(same_block, x.reshape(rows, count, size, 1, size), 0.0)
    return full.reshape(rows, count * size, count * size)


def _diagonal_blocks(x: jax.Array, size: int) -> jax.Array:
    """[M, S*c, S*c] -> its diagonal blocks [M*S, c, c]."""
    rows, chunk = x.shape[0], x.shape[-1]
    count = chunk // size
    blocks = x.reshape(rows, count, size, count, size)
    picked = jnp.stack([blocks[:, s, :, s, :] for s in range(count)], axis=1)
    return picked.reshape(rows * count, size, size)


def _diagonal(x: jax.Array) -> jax.Array:
    """[M, C, C] -> [M, C] diagonal entries."""
    return jnp.diagonal(x, axis1=-2, axis2=-1)


def _earlier_parts(q, k, g):
    """Row factors, column-masked keys and the column factors of sub-chunks 1..S-1 (sub-chunk 0 has
    no earlier columns), or None when the chunk is a single sub-chunk.

    Sub-chunk 0 is left out rather than masked to zero: a dot against an operand XLA can fold to a
    constant zero is the XLA:CPU miscompile described in `gla_simple.chunked`.
    """
    rows, chunk, keys = q.shape
    size = _sub_chunk(chunk)
    count = chunk // size
    if count == 1:
        return None
    row, column, _ = _vector_factors(g)
    earlier_columns = _earlier_columns(chunk, size)[1:]
    q_rows = q.reshape(rows, count, size, keys)[:, 1:] * row[:, 1:]  # [M, S-1, c, K]
    k_columns = jnp.where(earlier_columns, k[:, None, :, :] * column[:, 1:], 0.0)  # [M, S-1, C, K]
    return q_rows, k_columns, column[:, 1:], earlier_columns, row[:, 1:]


def _with_first_sub_chunk_zero(x: jax.Array) -> jax.Array:
    """[M, S-1, ...] for sub-chunks 1..S-1 -> [M, S, ...] with zeros for sub-chunk 0."""
    return jnp.concatenate([jnp.zeros_like(x[:, :1]), x], axis=1)


def _vector_scores(q, k, g):
    rows, chunk, keys = q.shape
    size = _sub_chunk(chunk)
    _, _, within = _vector_factors(g)
    q_flat, k_flat = q.reshape(-1, size, keys), k.reshape(-1, size, keys)
    strictly_lower = lower_triangle(size, strict=True)[:, :, None]
    strict = jnp.sum(jnp.where(strictly_lower, q_flat[:, :, None, :] * k_flat[:, None, :, :] * within, 0.0), axis=-1)
    diagonal = jnp.sum(q * k, axis=-1)  # [M, C]
    on_diagonal = jnp.where(jnp.eye(chunk, dtype=bool), diagonal[:, :, None], 0.0)
    scores = _block_diagonal(strict, rows) + on_diagonal
    parts = _earlier_parts(q, k, g)
    if parts is not None:
        q_rows, k_columns = parts[:2]
        earlier = _with_first_sub_chunk_zero(einsum("msik,msjk->msij", q_rows, k_columns))
        scores = scores + earlier.reshape(rows, chunk, chunk)
    return scores


def _vector_score_grads(d_scores, q, k, g):
    rows, chunk, keys = q.shape
    size = _sub_chunk(chunk)
    count = chunk // size
    _, _, within = _vector_factors(g)
    strictly_lower = lower_triangle(size, strict=True)[:, :, None]
    d_within = jnp.where(strictly_lower, _diagonal_blocks(d_scores, size)[..., None] * within, 0.0)  # [M*S, c, c, K]
    q_flat, k_flat = q.reshape(-1, size, keys), k.reshape(-1, size, keys)
    dq_strict = jnp.sum(d_within * k_flat[:, None, :, :], axis=2).reshape(q.shape)
    dk_strict = jnp.sum(d_within * q_flat[:, :, None, :], axis=1).reshape(k.shape)
    parts = _earlier_parts(q, k, g)
    if parts is not None:
        q_rows, k_columns, column, earlier_columns, row = parts
        d_rows = d_scores.reshape(rows, count, size, chunk)[:, 1:]
        dq_earlier = row * einsum("msij,msjk->msik", d_rows, k_columns)
        dq_strict = dq_strict + _with_first_sub_chunk_zero(dq_earlier).reshape(q.shape)
        from_rows = jnp.where(earlier_columns, column * einsum("msij,msik->msjk", d_rows, q_rows), 0.0)
        dk_strict = dk_strict + jnp.sum(from_rows, axis=1)
    d_diagonal = _diagonal(d_scores)[..., None]  # [M, C, 1]
    d_b = q * dq_strict - k * dk_strict
    return dq_strict + d_diagonal * k, dk_strict + d_diagonal * q, d_b


# --------------------------------------------------------------------------- public


def _flat(x: jax.Array) -> jax.Array:
    return x.reshape(-1, *x.shape[-2:])


def scores(q: jax.Array, k: jax.Array, g: jax.Array) -> jax.Array:
    """Intra-chunk scores A [..., C, C] (see the module doc) from q, k [..., C, K] and g [..., C, 1|K]."""
    if is_scalar_gate(g):
        return _scalar_scores(q, k, g)
    chunk = q.shape[-2]
    return _vector_scores(_flat(q), _flat(k), _flat(g)).reshape(*q.shape[:-2], chunk, chunk)


def score_grads(
    d_scores: jax.Array, q: jax.Array, k: jax.Array, g: jax.Array, scores: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of sum(d_scores ∘ scores(q, k, g)); `scores` is that value, already computed.

    Returns:
      dq, dk [..., C, K] and d b [..., C, 1|K]: the gradient with respect to the cumulative
      decay b_t = Σ_{s <= t} g_s (reverse-cumsum it for g), formed without the cancelling
      diagonal terms (see the module doc).
    """
    if is_scalar_gate(g):
        return _scalar_score_grads(d_scores, q, k, g, scores)
    dq, dk, d_b = _vector_score_grads(_flat(d_scores), _flat(q), _flat(k), _flat(g))
    return dq.reshape(q.shape), dk.reshape(k.shape), d_b.reshape(g.shape)
