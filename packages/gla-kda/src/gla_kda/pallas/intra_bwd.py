"""Backward per-chunk gradient kernel: dq, dk, dv, dbeta and dg of every chunk (parallel grid).

Inputs per chunk: the state S before it (recomputed by the state kernel), dS the gradient of
the state after it and ddelta (both from the reverse kernel), dO, and Tinv = (I + Akk)^-1.
With y = beta (v - k exp(G) S) the forward is delta = Tinv y, o = scale q exp(G) S + Aqk delta,
S_next = exp(G_last) S + (k exp(G_last - G))^T delta, so (q below is scale * q):
  dAqk = tril(dO delta^T)            dTinv = ddelta y^T        dy = Tinv^T ddelta
  dAkk = -strict_tril(Tinv^T dTinv Tinv^T)   (Akk is strictly lower: no diagonal gradient)
  and the gated products Aqk, Akk = beta (k k^T decayed) are differentiated by `chunk_math`.
dg is the gradient with respect to the per-step log decays g themselves: every term is summed
over exactly the steps its exponent spans (`Decays.gate_grad`, `GatedGrads`). The gradient
with respect to the cumsum G, reverse-cumsummed into dg, would hold the row and column terms
of every intra-chunk pair that does not span a step, which cancel exactly: for strong decays
those terms are ~35x dg, and their rounding swamped dg (and dA_log, which sums dg * gate).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_core.kit import column_to_row, fold_vmap, row_to_column
from gla_kda.pallas import chunk_math as cm
from gla_kda.pallas.config import KernelConfig, compiler_params


def intra_bwd_kernel(
    q_ref,
    k_ref,
    v_ref,
    g_ref,
    g_lo_ref,
    beta_ref,
    tinv_ref,
    h_ref,
    dstate_ref,
    ddelta_ref,
    do_ref,
    dq_ref,
    dk_ref,
    dv_ref,
    dbeta_ref,
    dg_ref,
    *,
    config: KernelConfig,
):
    """Blocks: q, k, g, g_lo (sub-block-local decay cumsum, hi and lo parts) [C, K]; v, ddelta, do [C, V]; beta [1, C];
    tinv [C, C]; h, dstate [K, V].

    Outputs (float32): dq, dk, dg [C, K] (dq per value head, already multiplied by scale; dg with
    respect to the per-step log decays); dv [C, V]; dbeta [1, C].
    """
    sb = cm.SubBlocks(config.blocks.chunk_size, config.blocks.sub_chunk)
    dtype, c = config.mxu_dtype, sb.chunk
    q = q_ref[...].astype(cm.F32) * config.scale
    k = k_ref[...].astype(cm.F32)
    v = v_ref[...].astype(cm.F32)
    decays = cm.Decays(g_ref[...], sb, g_lo_ref[...])
    beta = row_to_column(beta_ref[...])
    tinv = tinv_ref[...]
    state = h_ref[...].astype(cm.F32)
    dstate = dstate_ref[...].astype(cm.F32)
    ddelta = ddelta_ref[...].astype(cm.F32)
    do = do_ref[...].astype(cm.F32)

    decay = jnp.exp(decays.cum)
    to_end = jnp.exp(decays.to_end)
    k_decayed, q_decayed, k_to_end = k * decay, q * decay, k * to_end
    projected = v - cm.dot(k_decayed, state, dtype)
    y = beta * projected
    delta = cm.dot(tinv, y, dtype)

    d_q_decayed = cm.dot(do, state, dtype, trans_b=True)
    d_aqk = jnp.where(cm.lower_mask(c, strict=False), cm.dot(do, delta, dtype, trans_b=True), 0.0)
    d_k_to_end = cm.dot(delta, dstate, dtype, trans_b=True)
    dy = cm.dot(tinv, ddelta, dtype, trans_a=True)
    dv = beta * dy
    dbeta = jnp.sum(dy * projected, axis=1, keepdims=True)
    d_k_decayed = -beta * cm.dot(dy, state, dtype, trans_b=True)
    d_tinv = cm.dot(ddelta, y, dtype, trans_b=True)
    d_akk = cm.dot(cm.dot(tinv, d_tinv, cm.F32, trans_a=True), tinv, cm.F32, trans_b=True)
    d_akk = jnp.where(cm.lower_mask(c, strict=True), -d_akk, 0.0)

    # Akk = beta * P[k] (strict), Aqk = P[q] (incl. the diagonal): W = d_akk with a = beta k, and d_aqk with a = q.
    grads = cm.gated_grads([(d_akk, beta * k), (d_aqk, q)], k, decays, dtype, config.unroll)
    (rows_kk, rows_qk), (cols_kk, cols_qk) = grads.rows, grads.cols
    dbeta = dbeta + jnp.sum(k * rows_kk, axis=1, keepdims=True)

    dq = d_q_decayed * decay + rows_qk
    dk = d_k_decayed * decay + d_k_to_end * to_end + beta * rows_kk + cols_kk + cols_qk
    # q exp(G), k exp(G) depend on the decays up to their step, k exp(G_last - G) on those after it,
    # and the carried state on all of them.
    state_term = column_to_row(jnp.sum(state * dstate, axis=1, keepdims=True)) * jnp.exp(decays.total)
    dg = (
        decays.gate_grad(
            after=d_q_decayed * q_decayed + d_k_decayed * k_decayed,
            before=d_k_to_end * k_to_end,
            after_block=grads.after_block,
            before_block=grads.before_block,
        )
        + grads.direct
        + state_term
    )

    dq_ref[...] = dq * config.scale
    dk_ref[...] = dk
    dv_ref[...] = dv
    dbeta_ref[...] = column_to_row(dbeta)
    dg_ref[...] = dg


def chunk_index(b, j, t):
    return (b, j, t, 0)


def qk_index(b, j, t, *, group: int):
    return (b, jax.lax.div(j, jnp.int32(group)), t, 0)


def beta_index(b, j, t):
    return (b, j, t, 0, 0)


def intra_bwd_cost(batch, heads, num_chunks, c, k, v, s, itemsize):
    steps = batch * heads * num_chunks
    flops = steps * (2 * c * k * v * 4 + 2 * c * c * v * 4 + 2 * 2 * c * c * c + 8 * 2 * c * c * k + 8 * c * s * k)
    transcendentals = steps * (2 * s + 2 * c // s + 2) * c * k
    bytes_accessed = steps * (
        2 * c * k * itemsize
        + c * v * itemsize * 3
        + 2 * c * k * 4
        + c * 4
        + c * c * 4
        + 2 * k * v * itemsize
        + (3 * c * k + c * v + c) * 4
    )
    return pl.CostEstimate(flops=flops, transcendentals=transcendentals, bytes_accessed=bytes_accessed)


def launch_intra_bwd(q, k, v, g, g_lo, beta, tinv, h, dstate, ddelta, do, config: KernelConfig):
    """Per-chunk gradients.

    Args:
      q, k: [B, H, Tp, K]; v, ddelta, do: [B, HV, Tp, V]; g, g_lo: [B, HV, Tp, K] float32
      sub-block-local decay cumsum (`layout.local_cumsum`);
      beta: [B, HV, NT, 1, C]; tinv: [B, HV, Tp, C]; h, dstate: [B, HV, NT*K, V].
    Returns (float32): dq, dk, dg [B, HV, Tp, K] (per value head); dv [B, HV, Tp, V];
      dbeta [B, HV, NT, 1, C].
      Under `jax.vmap` the mapped axis folds into B (`gla_core.pallas_transforms.fold_vmap`).
    """
    launch = functools.partial(_launch_intra_bwd, config=config)
    return fold_vmap(launch, (q, k, v, g, g_lo, beta, tinv, h, dstate, ddelta, do), in_axes=(0,) * 11, out_axes=0)


def _launch_intra_bwd(q, k, v, g, g_lo, beta, tinv, h, dstate, ddelta, do, *, config: KernelConfig):
    batch, heads, padded_len, key_dim = g.shape
    value_dim = v.shape[-1]
    c = config.blocks.chunk_size
    num_chunks = padded_len // c
    qk_spec = pl.BlockSpec((None, None, c, key_dim), functools.partial(qk_index, group=config.group))
    key_spec = pl.BlockSpec((None, None, c, key_dim), chunk_index)
    value_spec = pl.BlockSpec((None, None, c, value_dim), chunk_index)
    state_spec = pl.BlockSpec((None, None, key_dim, value_dim), chunk_index)
    beta_spec = pl.BlockSpec((None, None, None, 1, c), beta_index)
    f32 = jnp.float32
    with jax.named_scope("kda_intra_bwd"):
        return pl.pallas_call(
            functools.partial(intra_bwd_kernel, config=config),
            grid=(batch, heads, num_chunks),
            in_specs=[
                qk_spec,
                qk_spec,
                value_spec,
                key_spec,
                key_spec,
                beta_spec,
                pl.BlockSpec((None, None, c, c), chunk_index),
                state_spec,
                state_spec,
                value_spec,
                value_spec,
            ],
            out_specs=[key_spec, key_spec, value_spec, beta_spec, key_spec],
            out_shape=[
                jax.ShapeDtypeStruct(g.shape, f32),
                jax.ShapeDtypeStruct(g.shape, f32),
                jax.ShapeDtypeStruct(v.shape, f32),
                jax.ShapeDtypeStruct(beta.shape, f32),
                jax.ShapeDtypeStruct(g.shape, f32),
            ],
            compiler_params=compiler_params(sequential_time=False),
            cost_estimate=intra_bwd_cost(
                batch, heads, num_chunks, c, key_dim, value_dim, config.blocks.sub_chunk, config.mxu_dtype.itemsize
            ),
            interpret=config.interpret_arg,
            name="kda_intra_bwd",
        )(q, k, v, g, g_lo, beta, tinv, h, dstate, ddelta, do)
