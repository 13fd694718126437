"""Backward per-chunk gradient kernel: dq, dk, dv, dbeta and dg of every chunk (parallel grid).

Inputs per chunk: the state S before it (recomputed by the state kernel), dS the gradient of
the state after it and ddelta (both from the reverse kernel), dO, and Tinv = (I + Akk)^-1.
With y = beta (v - k exp(G) S) the forward is delta = Tinv y, o = scale q exp(G) S + Aqk delta,
S_next = exp(G_last) S + (k exp(G_last - G))^T delta, so (q below is scale * q):
  dAqk = tril(dO delta^T)            dTinv = ddelta y^T        dy = Tinv^T ddelta
  dAkk = -strict_tril(Tinv^T dTinv Tinv^T) = -strict_tril(dy delta^T)
  (Akk is strictly lower: no diagonal gradient; dTinv has rank V, so Tinv^T ddelta y^T Tinv^T
  is the product of dy and delta = Tinv y, both already at hand)
  and the gated products Aqk, Akk = beta (k k^T decayed) are differentiated by `chunk_math`.
dg is the gradient with respect to the per-step log decays g themselves: every term is summed
over exactly the steps its exponent spans (`Decays.gate_grad`, `gated_grads.GatedGrads`). The gradient
with respect to the cumsum G, reverse-cumsummed into dg, would hold the row and column terms
of every intra-chunk pair that does not span a step, which cancel exactly: for strong decays
those terms are ~35x dg, and their rounding swamped dg (and dA_log, which sums dg * gate).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_core.kit import column_to_row, fold_vmap, row_to_column
from gla_kda.pallas import chunk_math as cm
from gla_kda.pallas import poison as nf
from gla_kda.pallas.config import KernelConfig, compiler_params, head_block, token_block
from gla_kda.pallas.gated_grads import diagonals_in_range, gated_grads


def intra_bwd_kernel(
    q_ref,
    k_ref,
    v_ref,
    g_ref,
    beta_ref,
    tinv_ref,
    h_ref,
    dstate_ref,
    ddelta_ref,
    do_ref,
    poison_ref,
    dq_ref,
    dk_ref,
    dv_ref,
    dbeta_ref,
    dg_ref,
    *,
    config: KernelConfig,
):
    """Blocks of n chunks of one value head: q, k [n*C, K] (input dtype, non-finite entries read as 0);
    g [n*C, K] raw per-step log decays (cleaned and cumsummed here, `chunk_math.Decays.of_steps`);
    v [n*C, V] (non-finite entries read as 0), ddelta, do [n*C, V] (do poisoned here as the forward
    poisoned o, from its poison rows [n*8, V]: `gla_kda.pallas.poison`); beta [n, 1, C] (non-finite
    entries read as 0); tinv [n*C, C]; h, dstate [n*K, V].

    Outputs: dq, dk [n*C, K] (per value head, dq already multiplied by scale) and dv [n*C, V], each
    in its ref's dtype; dg [n*C, K] float32 with respect to the raw log decays (through their
    cleaning, `chunk_math.clean_log_decay_grad`); dbeta [n, 1, C] float32. The chunks are independent.
    """
    c, key_dim = config.blocks.chunk_size, q_ref.shape[-1]
    chunks = range(beta_ref.shape[0])

    def write(anchor_range):
        """Writes every output, the diagonal sub-blocks anchored within `anchor_range` (None: exact);
        returns the chunks' `Decays`."""
        products = []
        for n in chunks:
            rows, states = pl.ds(n * c, c), pl.ds(n * key_dim, key_dim)
            raw_q = q_ref[rows, :]
            do = nf.poison_chunk(do_ref[rows, :].astype(cm.F32), poison_ref, n, raw_q)
            products.append(
                chunk_products(
                    cm.finite(raw_q) * config.scale,
                    cm.finite(k_ref[rows, :]),
                    cm.finite(v_ref[rows, :]),
                    g_ref[rows, :],
                    row_to_column(cm.finite(beta_ref[n])),
                    tinv_ref[rows, :],
                    h_ref[states, :].astype(cm.F32),
                    dstate_ref[states, :].astype(cm.F32),
                    ddelta_ref[rows, :].astype(cm.F32),
                    do,
                    config,
                )
            )
        # Second stage once every chunk's products are issued: the chunks' chains interleave.
        for n, chunk in zip(chunks, products, strict=True):
            rows = pl.ds(n * c, c)
            dq, dk, dv, dbeta, dg = chunk_grads(chunk, config, anchor_range)
            dq_ref[rows, :] = (dq * config.scale).astype(dq_ref.dtype)
            dk_ref[rows, :] = dk.astype(dk_ref.dtype)
            dv_ref[rows, :] = dv.astype(dv_ref.dtype)
            dbeta_ref[n] = column_to_row(dbeta)
            dg_ref[rows, :] = cm.clean_log_decay_grad(g_ref[rows, :], dg)
        return [chunk.decays for chunk in products]

    anchor_range = config.anchor
    decays = write(anchor_range)
    if anchor_range is None:
        return
    # A step with a chunk out of the anchor range is recomputed with the exact diagonal sub-blocks.
    in_range = functools.reduce(jnp.logical_and, [diagonals_in_range(d, anchor_range) for d in decays])

    @pl.when(jnp.logical_not(in_range))
    def _exact():
        write(None)


@dataclasses.dataclass(frozen=True)
class ChunkProducts:
    """One chunk's inputs and the matrix products of its gradient before the gated scores' (all float32).

    q (scaled), k, decay = exp(G), to_end = exp(G_last - G), d_q_decayed, d_k_decayed, d_k_to_end
    [C, K]; projected = v - k exp(G) S, dy [C, V]; beta [C, 1]; state, dstate [K, V]; d_akk,
    d_aqk [C, C] the cotangents of Akk and Aqk; decays the chunk's `chunk_math.Decays`.
    """

    q: jax.Array
    k: jax.Array
    beta: jax.Array
    state: jax.Array
    dstate: jax.Array
    decays: cm.Decays
    decay: jax.Array
    to_end: jax.Array
    projected: jax.Array
    dy: jax.Array
    d_q_decayed: jax.Array
    d_k_decayed: jax.Array
    d_k_to_end: jax.Array
    d_akk: jax.Array
    d_aqk: jax.Array


def chunk_products(q, k, v, g, beta, tinv, state, dstate, ddelta, do, config: KernelConfig):
    """`ChunkProducts` of one chunk.

    q (scaled), k [C, K]; v, ddelta, do [C, V]; g [C, K] the raw per-step log decays; beta [C, 1];
    tinv [C, C] (`config.store_dtype`); state, dstate [K, V]; the others float32.
    """
    sb = cm.SubBlocks(config.blocks.chunk_size, config.blocks.sub_chunk)
    dtype, c = config.mxu_dtype, sb.chunk
    decays = cm.Decays.of_steps(g, sb)
    decay = jnp.exp(decays.cum)
    projected = v - cm.dot(k * decay, state, dtype)
    y = beta * projected
    delta = cm.dot(tinv, y, dtype)
    dy = cm.dot(tinv, ddelta, dtype, trans_a=True)
    # dO and dy against the state and delta: one product, [2C, V] x [K + C, V]^T.
    key_dim = state.shape[0]
    against = cm.dot(jnp.concatenate([do, dy], axis=0), jnp.concatenate([state, delta], axis=0), dtype, trans_b=True)
    return ChunkProducts(
        q=q,
        k=k,
        beta=beta,
        state=state,
        dstate=dstate,
        decays=decays,
        decay=decay,
        to_end=jnp.exp(decays.to_end),
        projected=projected,
        dy=dy,
        d_q_decayed=against[:c, :key_dim],
        d_k_decayed=-beta * against[c:, :key_dim],
        d_k_to_end=cm.dot(delta, dstate, dtype, trans_b=True),
        d_akk=jnp.where(cm.lower_mask(c, strict=True), -against[c:, key_dim:], 0.0),
        d_aqk=jnp.where(cm.lower_mask(c, strict=False), against[:c, key_dim:], 0.0),
    )


def chunk_grads(p: ChunkProducts, config: KernelConfig, anchor_range: float | None):
    """(dq before the scale, dk, dv [C, V], dbeta [C, 1], dg) of one chunk, float32 ([C, K] unless stated).

    anchor_range: of the diagonal sub-blocks' gated products (`gated_grads.gated_grads`), or None
    for the exact loop."""
    dtype, q, k, beta, decays = config.mxu_dtype, p.q, p.k, p.beta, p.decays
    dv = beta * p.dy
    dbeta = jnp.sum(p.dy * p.projected, axis=1, keepdims=True)
    # Akk = beta * P[k] (strict), Aqk = P[q] (incl. the diagonal): W = d_akk with a = beta k, and d_aqk with a = q.
    grads = gated_grads([(p.d_akk, beta * k), (p.d_aqk, q)], k, decays, dtype, config.unroll, anchor_range)
    (rows_kk, rows_qk), (cols_kk, cols_qk) = grads.rows, grads.cols
    dbeta = dbeta + jnp.sum(k * rows_kk, axis=1, keepdims=True)

    dq = p.d_q_decayed * p.decay + rows_qk
    dk = p.d_k_decayed * p.decay + p.d_k_to_end * p.to_end + beta * rows_kk + cols_kk + cols_qk
    # q exp(G), k exp(G) depend on the decays up to their step, k exp(G_last - G) on those after it,
    # and the carried state on all of them.
    state_term = column_to_row(jnp.sum(p.state * p.dstate, axis=1, keepdims=True)) * jnp.exp(decays.total)
    dg = (
        decays.gate_grad(
            after=p.d_q_decayed * (q * p.decay) + p.d_k_decayed * (k * p.decay),
            before=p.d_k_to_end * (k * p.to_end),
            after_block=grads.after_block,
            before_block=grads.before_block,
            dtype=dtype,
        )
        + grads.direct
        + state_term
    )
    return dq, dk, dv, dbeta, dg


def intra_bwd_cost(batch, heads, num_chunks, c, k, v, s, itemsize):
    steps = batch * heads * num_chunks
    flops = steps * (2 * c * k * v * 4 + 2 * c * c * v * 4 + 2 * 2 * c * c * c + 8 * 2 * c * c * k + 8 * c * s * k)
    transcendentals = steps * (2 * s + 2 * c // s + 2) * c * k
    bytes_accessed = steps * (
        2 * c * k * itemsize
        + c * v * itemsize * 3
        + c * k * 4
        + c * 4
        + c * c * 4
        + 2 * k * v * itemsize
        + (3 * c * k + c * v + c) * 4
    )
    return pl.CostEstimate(flops=flops, transcendentals=transcendentals, bytes_accessed=bytes_accessed)


def launch_intra_bwd(q, k, v, g, beta, tinv, h, dstate, ddelta, do, poison_rows, config: KernelConfig):
    """Per-chunk gradients, read and written in the forward's token-major layout (no transposed copies).

    Args:
      q, k: [B, Tp, H*K]; v: [B, Tp, HV*V] (token-major, `layout.to_tokens`; non-finite entries read as 0);
      g: [B, Tp, HV*K] float32 raw per-step log decays (cleaned as the forward kernels clean them);
      beta: [B, HV, NT, 1, C]; tinv: [B, HV, Tp, C]; h: [B, NT*K, HV*V] (`state.launch_state`: rows
      n*K.. the state before chunk n, lanes j*V.. value head j); dstate: [B, NT*K, HV*V] (the same
      layout, the gradient of the state after chunk n) and ddelta, do: [B, Tp, HV*V] (token-major),
      both from `state_bwd.launch_state_bwd`; poison_rows: [B, NT*8, HV*V] float32, the forward's
      (`gla_kda.pallas.poison`).
    Returns: dq, dk [B, Tp, HV*K] (per value head, token-major; in q's dtype, or float32 when value
      heads share q/k heads and the caller sums them); dv [B, Tp, HV*V] in v's dtype; dg [B, Tp, HV*K]
      float32 with respect to the raw g; dbeta [B, HV, NT, 1, C] float32.
      Under `jax.vmap` the mapped axis folds into B (`gla_core.pallas_transforms.fold_vmap`).
    """
    launch = functools.partial(_launch_intra_bwd, config=config)
    args = (q, k, v, g, beta, tinv, h, dstate, ddelta, do, poison_rows)
    return fold_vmap(launch, args, in_axes=(0,) * 11, out_axes=0)


def _launch_intra_bwd(q, k, v, g, beta, tinv, h, dstate, ddelta, do, poison_rows, *, config: KernelConfig):
    batch, heads = beta.shape[:2]
    padded_len, key_dim = g.shape[1], g.shape[2] // heads
    value_dim = v.shape[-1] // heads
    c = config.blocks.chunk_size
    num_chunks = padded_len // c
    per_step = config.blocks.per_step(num_chunks, config.blocks.grad_chunks_per_step)
    rows = per_step * c
    qk_spec = token_block(rows, key_dim, config.group)
    key_spec = token_block(rows, key_dim)
    value_spec = token_block(rows, value_dim)
    state_spec = token_block(per_step * key_dim, value_dim)
    beta_spec = head_block(per_step, 1, c)
    f32 = jnp.float32
    qk_grad_dtype = q.dtype if config.group == 1 else f32
    with jax.named_scope("kda_intra_bwd"):
        return pl.pallas_call(
            functools.partial(intra_bwd_kernel, config=config),
            grid=(batch, heads, num_chunks // per_step),
            in_specs=[
                qk_spec,
                qk_spec,
                value_spec,
                key_spec,
                beta_spec,
                head_block(rows, c),
                state_spec,
                state_spec,
                value_spec,
                value_spec,
                token_block(per_step * nf.ROWS_PER_CHUNK, value_dim),
            ],
            out_specs=[key_spec, key_spec, value_spec, beta_spec, key_spec],
            out_shape=[
                jax.ShapeDtypeStruct(g.shape, qk_grad_dtype),
                jax.ShapeDtypeStruct(g.shape, qk_grad_dtype),
                jax.ShapeDtypeStruct(v.shape, v.dtype),
                jax.ShapeDtypeStruct(beta.shape, f32),
                jax.ShapeDtypeStruct(g.shape, f32),
            ],
            compiler_params=compiler_params(sequential_time=False),
            cost_estimate=intra_bwd_cost(
                batch, heads, num_chunks, c, key_dim, value_dim, config.blocks.sub_chunk, config.mxu_dtype.itemsize
            ),
            interpret=config.interpret_arg,
            name="kda_intra_bwd",
        )(q, k, v, g, beta, tinv, h, dstate, ddelta, do, poison_rows)
