"""Intra-chunk quantities of chunked KDA in plain `jnp`, batched over every chunk and head.

Within one chunk of C steps let G_i = g_0 + ... + g_i (cumulative log decay from the chunk
start, [K]) and write D(i, j) = G_i - G_j = g_{j+1} + ... + g_i. With the state S0 entering
the chunk, the delta rule unrolls to (WY form)

    Akk[i, j] = beta_i * sum_k k_i[k] k_j[k] exp(D(i, j)[k])      j < i   (strict)
    Aqk[i, j] =          sum_k q_i[k] k_j[k] exp(D(i, j)[k])      j <= i
    w = (I + Akk)^-1 diag(beta) (exp(G) * k),   u = (I + Akk)^-1 diag(beta) v
    delta = u - w S0                      (the corrected values written into the state)
    o     = (exp(G) * q) S0 + Aqk delta
    S_end = diag(exp(G_C-1)) S0 + (exp(D(C-1, j)) * k_j)^T delta

Numerics. Every exponent is a sum of log decays (<= 0), so no exp overflows. Decay sums are
never formed as the difference of two long prefix sums either: with strong decays G reaches
-1e4 within a chunk, and G_i - G_j would lose the low bits that matter for nearby i, j (an
error of ulp(|G|) in the exponent). The chunk is cut into sub-blocks of `sub_block` rows:
  - inside a diagonal sub-block, D(i, j) is summed directly (a 0/1 triangular tensor times g);
  - a row block I meets every column j of an earlier block J through the anchor a = the
    last row of block I-1: exp(D(i, a)) (the in-block prefix sum of row i) times
    exp(D(a, j)) (the in-block suffix sum after j plus the totals of the blocks between);
  - exp(D(C-1, j)) uses a suffix sum.
Prefix and suffix sums are triangular matmuls (cheaper to compile than cumsum on XLA:CPU).

Layout: one leading batch axis `[N, C, D]` (N = chunks x batch x heads); beta `[N, C]`. The
batched products keep a single batch axis on purpose: XLA:CPU (jax 0.10.2) miscompiles the
gradients of some einsums with several batch axes one of which has size 1 (segfault).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_SUB_BLOCK = 8  # diagonal sub-block of the scores: measured fastest on CPU among 4, 8, 16
INVERSE_BLOCK = 16  # diagonal blocks inverted by forward substitution in `unit_lower_inverse`

einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class IntraChunk:
    """Per-chunk quantities the inter-chunk recurrence and the output need.

    qg: [N, C, K] exp(G) * q;  kd: [N, C, K] exp(D(C-1, j)) * k;  gamma: [N, K] exp(G_C-1);
    w: [N, C, K];  u: [N, C, V];  Aqk: [N, C, C] (lower triangular incl. the diagonal).
    """

    qg: jax.Array
    kd: jax.Array
    gamma: jax.Array
    w: jax.Array
    u: jax.Array
    Aqk: jax.Array


def prefix_and_suffix_sums(g):
    """Inclusive prefix sums and exclusive suffix sums of g [M, L, K] along L, as one triangular matmul.

    Returns (prefix [M, L, K] = sum of g[t] for t <= i, suffix [M, L, K] = sum of g[t] for t > i).
    """
    length = g.shape[-2]
    t = np.arange(length)
    triangles = np.concatenate([t[None, :] <= t[:, None], t[None, :] > t[:, None]], axis=0)
    sums = einsum("it,mtk->mik", jnp.asarray(triangles, g.dtype), g)
    return sums[:, :length], sums[:, length:]


def _diagonal_block_scores(qb, kb, gb):
    """Scores inside each diagonal sub-block; qb, kb, gb [M, c, K] -> ([M, c, c] qk incl. diagonal, kk strict).

    Its [M, c, c, K] decay tensor is c times the size of k: `_diagonal_blocks` rematerializes it in
    the backward (the default); FLA's `disable_recompute` keeps it instead.
    """
    m, c, key_dim = gb.shape
    i, j, t = np.ogrid[:c, :c, :c]
    between = jnp.asarray(((j < t) & (t <= i)).reshape(c * c, c), gb.dtype)  # D(i, j) = sum_t [j < t <= i] g_t
    pair_sums = einsum("pt,mtk->mpk", between, gb).reshape(m, c, c, key_dim)  # [M, c(i), c(j), K]
    inclusive = jnp.asarray(np.tril(np.ones((c, c), bool)))[:, :, None]
    decay = jnp.where(inclusive, jnp.exp(jnp.where(inclusive, pair_sums, 0.0)), 0.0)
    k_decay = (decay * kb[:, None, :, :]).reshape(m * c, c, key_dim)  # [M*c(i), c(j), K]
    rows = jnp.stack([qb, kb], axis=2).reshape(m * c, 2, key_dim)  # q_i and k_i side by side
    scores = einsum("bsk,bjk->bsj", rows, k_decay).reshape(m, c, 2, c)
    return scores[:, :, 0], jnp.where(jnp.asarray(np.tril(np.ones((c, c), bool), -1)), scores[:, :, 1], 0.0)


_diagonal_blocks = jax.checkpoint(_diagonal_block_scores)


def _earlier_blocks(qb, kb, gb):
    """Scores of each row block I against every column of the blocks J < I.

    qb, kb, gb: [N, nb, c, K]. Returns (qk, kk) [N, nb, c, C] (zero for columns j >= s_I).
    exp(D(a_I, j)) = exp(suffix of j inside block J) * exp(totals of the blocks between J and I):
    both factors <= 1, and only tensors of the size of k (and a tiny [N, nb, nb, K]) are exponentiated.
    """
    n, nb, c, key_dim = gb.shape
    prefix, suffix = (x.reshape(gb.shape) for x in prefix_and_suffix_sums(gb.reshape(n * nb, c, key_dim)))
    row_decay = jnp.exp(prefix)  # exp(D(i, a_I)), a_I = last row of block I-1
    k_suffix = kb * jnp.exp(suffix)  # [N, nb(J), c, K]
    I, J, b = np.ogrid[:nb, :nb, :nb]
    between = jnp.asarray(((b > J) & (b < I)).reshape(nb * nb, nb), gb.dtype)
    block_gap = einsum("pb,nbk->npk", between, prefix[:, :, -1]).reshape(n, nb, nb, 1, key_dim)
    earlier = jnp.asarray(np.arange(nb)[None, :] < np.arange(nb)[:, None])[:, :, None, None]  # J < I
    gap_decay = jnp.where(earlier, jnp.exp(jnp.where(earlier, block_gap, 0.0)), 0.0)  # [N, nb(I), nb(J), 1, K]
    k_cols = (gap_decay * k_suffix[:, None]).reshape(n * nb, nb * c, key_dim)
    rows = (jnp.stack([qb, kb], axis=2) * row_decay[:, :, None]).reshape(n * nb, 2 * c, key_dim)
    scores = einsum("bik,bjk->bij", rows, k_cols).reshape(n, nb, 2, c, nb * c)
    return scores[:, :, 0], scores[:, :, 1]


def _with_diagonal(earlier, diag):
    """Puts the diagonal blocks [N, nb, c, c] into column block I of the rows [N, nb, c, C]."""
    n, nb, c, _ = diag.shape
    same_block = jnp.asarray(np.eye(nb, dtype=bool))[:, None, :, None]  # [nb(I), 1, nb(J), 1]
    full = jnp.where(same_block, diag[:, :, :, None, :], earlier.reshape(n, nb, c, nb, c))
    return full.reshape(n, nb, c, nb * c)


def decayed_scores(q, k, g, sub_block: int = DEFAULT_SUB_BLOCK, recompute: bool = True):
    """Aqk [N, C, C] (j <= i) and the unweighted Akk [N, C, C] (j < i) for q, k and the log decays g [N, C, K]
    (`recompute`: rematerialize the diagonal blocks' decay tensor in the backward instead of keeping it)."""
    n, C, K = g.shape
    c = min(sub_block, C)
    if C % c:
        raise ValueError(f"sub_block: expected a divisor of the chunk size {C}, got {sub_block}")
    nb = C // c
    diagonal_blocks = _diagonal_blocks if recompute else _diagonal_block_scores
    qk_diag, kk_diag = diagonal_blocks(q.reshape(-1, c, K), k.reshape(-1, c, K), g.reshape(-1, c, K))
    if nb == 1:
        return qk_diag, kk_diag
    blocked = (n, nb, c, K)
    qk_before, kk_before = _earlier_blocks(q.reshape(blocked), k.reshape(blocked), g.reshape(blocked))
    qk = _with_diagonal(qk_before, qk_diag.reshape(n, nb, c, c))
    kk = _with_diagonal(kk_before, kk_diag.reshape(n, nb, c, c))
    return qk.reshape(n, C, C), kk.reshape(n, C, C)


def _invert_unit_lower_blocks(A):
    """(I + A)^-1 for strictly lower triangular A [M, c, c], by forward substitution over the c rows."""
    c = A.shape[-1]
    eye = jnp.eye(c, dtype=A.dtype)

    def row(i, inverse):
        # Row i of (I + A)^-1 is e_i - sum_{j < i} A[i, j] * row j; A[i, j >= i] = 0.
        a_row = jax.lax.dynamic_index_in_dim(A, i, axis=1, keepdims=False)  # [M, c]
        new = eye[i] - einsum("mj,mjk->mk", a_row, inverse)
        return jax.lax.dynamic_update_index_in_dim(inverse, new, i, axis=1)

    return jax.lax.fori_loop(1, c, row, jnp.broadcast_to(eye, A.shape))


def unit_lower_inverse(A, block: int = INVERSE_BLOCK):
    """(I + A)^-1 for strictly lower triangular A [N, C, C], blocked.

    The diagonal sub-blocks are inverted by forward substitution, then row block I of the
    inverse is -inv(I + A_II) * sum_{K < I} A_IK inv_K: (nb - 1) steps of batched GEMMs.
    Plain jnp on purpose: no LAPACK custom call (its concurrent use from XLA:CPU threads
    was seen to deadlock the process).
    """
    n, C, _ = A.shape
    c = min(block, C)
    nb = C // c
    diagonal = jnp.stack([A[:, i * c : (i + 1) * c, i * c : (i + 1) * c] for i in range(nb)], axis=1)
    diagonal_inverse = _invert_unit_lower_blocks(diagonal.reshape(n * nb, c, c)).reshape(n, nb, c, c)
    rows = diagonal_inverse[:, 0]  # [N, c, c]: the first row block of the inverse (zeros right of it)
    inverse_rows = [jnp.pad(rows, ((0, 0), (0, 0), (0, C - c)))]
    for i in range(1, nb):
        above = jnp.concatenate(inverse_rows, axis=1)[:, :, : i * c]  # [N, i*c, i*c] rows/cols of blocks < i
        left = einsum("nab,nbc->nac", A[:, i * c : (i + 1) * c, : i * c], above)  # [N, c, i*c]
        block_row = jnp.concatenate([-einsum("nab,nbc->nac", diagonal_inverse[:, i], left), diagonal_inverse[:, i]], -1)
        inverse_rows.append(jnp.pad(block_row, ((0, 0), (0, 0), (0, C - (i + 1) * c))))
    return jnp.concatenate(inverse_rows, axis=1)


def intra_chunk(q, k, v, g, beta, sub_block: int = DEFAULT_SUB_BLOCK, recompute: bool = True) -> IntraChunk:
    """The WY quantities of every chunk.

    Args:
      q, k, g: [N, C, K] (q already scaled, g the per-step log decay);
      v: [N, C, V]; beta: [N, C]. Padded steps must have k = v = g = beta = 0.
      recompute: rematerialize the largest intermediate in the backward (see `decayed_scores`).

    Returns:
      `IntraChunk` (shapes in its docstring).
    """
    key_dim = g.shape[-1]
    Aqk, Akk = decayed_scores(q, k, g, sub_block, recompute)
    prefix, suffix = prefix_and_suffix_sums(g)
    decay = jnp.exp(prefix)  # exp(G)
    rhs = beta[..., None] * jnp.concatenate([decay * k, v], axis=-1)  # [N, C, K + V]
    wu = einsum("nij,njd->nid", unit_lower_inverse(beta[..., :, None] * Akk), rhs)
    return IntraChunk(
        qg=decay * q,
        kd=jnp.exp(suffix) * k,
        gamma=jnp.exp(prefix[:, -1]),
        w=wu[..., :key_dim],
        u=wu[..., key_dim:],
        Aqk=Aqk,
    )
