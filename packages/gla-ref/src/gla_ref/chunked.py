"""Chunked forms of every op: intra-chunk attention plus an inter-chunk state, in one scan over chunks.

Meant for float64 (`jax.enable_x64(True)`), where they equal `gla_ref.recurrent` to ~1e-12;
they compute in the promoted input dtype like the recurrences. They show the algebra the
chunk kernels implement. Inside a chunk of length C starting from state S, with the log
decays cumulated from the chunk start, `b_i = sum_{s <= i} g_s` (per key), every decay factor
is `exp(b_i - b_j)` for i >= j or `exp(b_i)`, never the exponential of a positive number when
the log decays are <= 0 (pairwise differences are masked before `exp`).

gla / simple_gla (simple_gla's scalar decay is broadcast over K):
  o_i     = scale * [ (q_i * exp(b_i))^T S + sum_{j <= i} (sum_k q_ik k_jk exp(b_ik - b_jk)) v_j ]
  S_end   = exp(b_C) * S + sum_j (k_j * exp(b_C - b_j)) v_j^T

kda: each step is S_i = D_i S_{i-1} + k_i u_i^T with the pseudo-value
  u_i = beta_i (v_i - (D_i S_{i-1})^T k_i). Collecting the chunk gives the lower triangular
  system (I + A) U = beta * (V - (K * exp(b)) S), A_ij = beta_i sum_k k_ik k_jk exp(b_ik - b_jk)
  for j < i, solved by forward substitution; then o and S_end as above with U for V.

Sequences are padded with zeros to a multiple of the chunk (zero k, v, beta and decay leave
the state unchanged). Varlen (`cu_seqlens`, B == 1) gathers the packed sequences into a zero-padded batch with
indices built on the host, so `cu_seqlens` must be concrete (not traced under `jit`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gla_core.errors import InvalidArgumentError, ShapeError
from gla_ref import gates

HIGHEST = jax.lax.Precision.HIGHEST


def _einsum(spec, *operands):
    return jnp.einsum(spec, *operands, precision=HIGHEST)


def _pairwise_decay(b, strict: bool):
    """`exp(b_i - b_j)` for i >= j (i > j when `strict`), 0 elsewhere: b `[..., C, HV, K]` -> `[..., C, C, HV, K]`."""
    size = b.shape[-3]
    rows, cols = np.arange(size)[:, None], np.arange(size)[None, :]
    mask = jnp.asarray((rows > cols) if strict else (rows >= cols))[:, :, None, None]
    diff = b[..., :, None, :, :] - b[..., None, :, :, :]
    return jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)


def _decayed_products(x, y, b, strict: bool):
    """`sum_k x_ik y_jk exp(b_ik - b_jk)` for i >= j (i > j when `strict`), else 0: `[..., C, C, HV]`."""
    return jnp.sum(x[..., :, None, :, :] * y[..., None, :, :, :] * _pairwise_decay(b, strict), axis=-1)


def _solve_lower(system, rhs):
    """`(I + system)^{-1} rhs` per chunk and head by forward substitution.

    system: strictly lower triangular `[B, N, C, C, HV]`; rhs `[B, N, C, HV, D]`. Row i is
    `x_i = rhs_i - sum_{j < i} system_ij x_j`, a scan over the C rows. (LAPACK's batched
    trsm is avoided on purpose: concurrent batched calls can deadlock jaxlib's CPU thread pool.)
    """
    size = system.shape[2]
    system = jnp.moveaxis(system, -1, 2)  # [B, N, HV, C, C]
    rhs = jnp.moveaxis(rhs, -2, 2)  # [B, N, HV, C, D]

    def row(i, solution):
        coefficients = jax.lax.dynamic_index_in_dim(system, i, axis=3, keepdims=False)  # [B, N, HV, C]
        value = jax.lax.dynamic_index_in_dim(rhs, i, axis=3, keepdims=False) - _einsum(
            "bnhj,bnhjd->bnhd", coefficients, solution
        )
        return jax.lax.dynamic_update_index_in_dim(solution, value, i, axis=3)

    solution = jax.lax.fori_loop(0, size, row, jnp.zeros_like(rhs))
    return jnp.moveaxis(solution, 2, -2)


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size"))
def _chunked(q, k, v, log_decay, beta, h0, scale, chunk_size):
    """Independent sequences, one per batch row.

    Args:
      q, k, log_decay: `[B, T, HV, K]`; v: `[B, T, HV, V]`; beta: `[B, T, HV]` (delta rule) or None;
      h0: `[B, HV, K, V]`.

    Every chunk's values are affine in its start state S: `U = U0 - M S` (`M = 0`, `U0 = v`
    without the delta rule), so the intra-chunk work runs for all chunks at once and only
    `S_next = exp(b_C) * S + Kd^T (U0 - M S)` (Kd = k * exp(b_C - b)) is a scan over chunks.

    Returns `(o [B, T, HV, V], final_state [B, HV, K, V])`.
    """
    batch, seq_len = q.shape[:2]
    num_chunks = max(1, -(-seq_len // chunk_size))
    padding = num_chunks * chunk_size - seq_len

    def to_chunks(x):  # [B, T, ...] -> [B, N, C, ...]
        x = jnp.pad(x, [(0, 0), (0, padding)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(batch, num_chunks, chunk_size, *x.shape[2:])

    q, k, v, log_decay = (to_chunks(x) for x in (q, k, v, log_decay))
    inclusive = jnp.asarray(np.tril(np.ones((chunk_size, chunk_size))), q.dtype)
    b = _einsum("ij,bnjhk->bnihk", inclusive, log_decay)  # [B, N, C, HV, K]: in-chunk cumulative decay
    b_last = b[:, :, -1]  # [B, N, HV, K]
    scores = _decayed_products(q, k, b, strict=False)  # [B, N, C, C, HV]
    if beta is None:
        values0, gain = v, None
    else:
        beta = to_chunks(beta)[..., None]  # [B, N, C, HV, 1]
        system = beta[..., 0][:, :, :, None] * _decayed_products(k, k, b, strict=True)
        solved = _solve_lower(system, jnp.concatenate([beta * v, beta * k * jnp.exp(b)], axis=-1))
        values0, gain = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]  # [B, N, C, HV, V], [.., K]
    carried = k * jnp.exp(b_last[:, :, None] - b)  # [B, N, C, HV, K]
    written = _einsum("bnjhk,bnjhv->bnhkv", carried, values0)  # [B, N, HV, K, V]
    transition = jnp.exp(b_last)[..., None] * jnp.eye(q.shape[-1], dtype=q.dtype)  # [B, N, HV, K, K]
    if gain is not None:
        transition = transition - _einsum("bnjhk,bnjhl->bnhkl", carried, gain)

    def advance(state, chunk):
        transition_n, written_n = chunk
        return _einsum("bhkl,bhlv->bhkv", transition_n, state) + written_n, state

    final_state, starts = jax.lax.scan(advance, h0, (jnp.moveaxis(transition, 1, 0), jnp.moveaxis(written, 1, 0)))
    starts = jnp.moveaxis(starts, 0, 1)  # [B, N, HV, K, V]: the state entering each chunk
    values = values0 if gain is None else values0 - _einsum("bnihk,bnhkv->bnihv", gain, starts)
    o = _einsum("bnihk,bnhkv->bnihv", q * jnp.exp(b), starts) + _einsum("bnijh,bnjhv->bnihv", scores, values)
    o = scale * o.reshape(batch, num_chunks * chunk_size, *o.shape[3:])
    return o[:, :seq_len], final_state


def _packed(q, k, v, log_decay, beta, h0, scale, chunk_size, boundaries):
    """Packed varlen input `[1, T, ...]` run as a batch of N zero-padded sequences.

    Zero padding leaves each state unchanged, so a zero-length sequence keeps `h0[n]`.
    Returns `(o [1, T, HV, V], final_state [N, HV, K, V])`.
    """
    starts, lengths = np.asarray(boundaries[:-1]), np.diff(boundaries)
    seq_len = q.shape[1]
    if seq_len == 0:
        return jnp.zeros((1, 0, *v.shape[2:]), v.dtype), h0
    longest = int(lengths.max())
    positions = np.arange(longest)
    valid = positions[None, :] < lengths[:, None]  # [N, L]
    gather = np.where(valid, starts[:, None] + positions[None, :], 0)

    def batched(x):
        if x is None:
            return None
        rows = x[0][gather]  # [N, L, ...]
        mask = jnp.asarray(valid).reshape(valid.shape + (1,) * (rows.ndim - 2))
        return jnp.where(mask, rows, 0)

    pieces = (batched(x) for x in (q, k, v, log_decay, beta))
    o, final_state = _chunked(*pieces, h0, scale, chunk_size)
    sequence = np.repeat(np.arange(len(lengths)), lengths)  # [T]
    offset = np.arange(seq_len) - starts[sequence]
    return o[sequence, offset][None], final_state


def _run(q, k, v, log_decay, beta, *, scale, initial_state, output_final_state, cu_seqlens, chunk_size):
    """`_chunked` per batch, or per sequence of a packed varlen input (host loop)."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise InvalidArgumentError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    batch, _, num_value_heads, key_dim = q.shape
    value_dim = v.shape[-1]
    dtype = q.dtype
    scale = key_dim**-0.5 if scale is None else scale
    log_decay = jnp.broadcast_to(log_decay, q.shape)
    if cu_seqlens is None:
        boundaries = None
        num_sequences = batch
    else:
        boundaries = [int(c) for c in np.asarray(cu_seqlens)]
        if batch != 1:
            raise ShapeError(f"cu_seqlens: packed sequences need batch size B == 1, got B = {batch}")
        num_sequences = len(boundaries) - 1
    state_shape = (num_sequences, num_value_heads, key_dim, value_dim)
    if initial_state is None:
        h0 = jnp.zeros(state_shape, dtype)
    else:
        if tuple(initial_state.shape) != state_shape:
            raise ShapeError(f"initial_state: expected shape [N, HV, K, V] = {state_shape}, got {initial_state.shape}")
        h0 = initial_state.astype(dtype)
    if boundaries is None:
        o, final_state = _chunked(q, k, v, log_decay, beta, h0, scale, chunk_size)
    else:
        o, final_state = _packed(q, k, v, log_decay, beta, h0, scale, chunk_size, boundaries)
    return o, (final_state if output_final_state else None)


def simple_gla(
    q,
    k,
    v,
    g=None,
    g_gamma=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    chunk_size=64,
):
    """Chunked `recurrent.simple_gla` (same arguments and returns, plus `chunk_size`)."""
    dtype = gates.compute_dtype(q, k, v, g, g_gamma, initial_state)
    log_decay = jnp.zeros(q.shape[:3], dtype)
    if g is not None:
        log_decay = log_decay + g.astype(dtype)
    if g_gamma is not None:
        log_decay = log_decay + g_gamma.astype(dtype)
    return _run(
        q.astype(dtype),
        k.astype(dtype),
        v.astype(dtype),
        log_decay[..., None],
        None,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )


def gla(q, k, v, gk, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=64):
    """Chunked `recurrent.gla` (same arguments and returns, plus `chunk_size`)."""
    if gk is None:
        raise InvalidArgumentError("gk: required for gla (per-key log decay [B, T, H, K])")
    dtype = gates.compute_dtype(q, k, v, gk, initial_state)
    return _run(
        q.astype(dtype),
        k.astype(dtype),
        v.astype(dtype),
        gk.astype(dtype),
        None,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )


def kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    chunk_size=64,
    **kda_options,
):
    """Chunked `recurrent.kda` (same arguments and returns, plus `chunk_size`)."""
    q, k, v, log_decay, beta = gates.prepare_kda(
        q,
        k,
        v,
        g,
        beta,
        initial_state=initial_state,
        **kda_options,
    )
    return _run(
        q,
        k,
        v,
        log_decay,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )


kda_gate = gates.kda_gate
