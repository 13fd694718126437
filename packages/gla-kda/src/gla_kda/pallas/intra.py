"""Forward intra-chunk kernel: the WY inverse (I + Akk)^-1 and the attention Aqk of every chunk.

Per chunk (C tokens of the user's q/k/g, read in place through token-major views, G the
within-chunk cumsum of the decay, formed in the kernel as its sub-block-local form, see
`chunk_math.Decays`):
  Akk_ij = beta_i sum_d k_id k_jd exp(G_id - G_jd)          j < i   (strictly lower)
  Tinv   = (I + Akk)^-1                                       (blocked forward substitution)
  Aqk_ij = scale sum_d q_id k_jd exp(G_id - G_jd)           j <= i
Every chunk is independent: the grid (B, HV, NT) is parallel on all axes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_core.kit import fold_vmap, row_to_column
from gla_kda.pallas import chunk_math as cm
from gla_kda.pallas.config import KernelConfig, compiler_params, token_block


def intra_kernel(q_ref, k_ref, g_ref, beta_ref, tinv_ref, aqk_ref, *, config: KernelConfig):
    """Blocks of n chunks: q, k [n*C, K] input dtype; g [n*C, K] raw per-step log decays (cleaned
    and cumsummed here, `chunk_math.Decays.of_steps`); beta [n, 1, C]; outputs tinv, aqk [n*C, C]
    float32.

    The chunks are independent; their (I + Akk)^-1 are solved together (`unit_lower_inverses`)
    so that the serial chains of the substitution interleave.
    """
    sb = cm.SubBlocks(config.blocks.chunk_size, config.blocks.sub_chunk)
    chunks = [pl.ds(n * sb.chunk, sb.chunk) for n in range(beta_ref.shape[0])]
    strict = cm.lower_mask(sb.chunk, strict=True)
    akks = []
    for n, rows in enumerate(chunks):
        q = cm.finite(q_ref[rows, :]) * config.scale
        k = cm.finite(k_ref[rows, :])
        decays = cm.Decays.of_steps(g_ref[rows, :], sb)
        kk, aqk_ref[rows, :] = cm.gated_scores([k, q], k, decays, config.mxu_dtype, config.unroll)
        akks.append(jnp.where(strict, row_to_column(beta_ref[n]) * kk, 0.0))
    for rows, tinv in zip(chunks, cm.unit_lower_inverses(akks, sb, config.unroll, config.mxu_dtype), strict=True):
        tinv_ref[rows, :] = tinv


def head_index(b, j, t):
    return (b, j, t, 0)


def beta_index(b, j, t):
    return (b, j, t, 0, 0)


def intra_cost(batch, heads, num_chunks, c, k, s, itemsize):
    """Flops and bytes of `intra_kernel` over the whole grid."""
    steps = batch * heads * num_chunks
    flops = steps * (2 * 2 * c * c * k + 3 * 2 * c * s * k + 2 * c * c * c + 2 * c * c * s)
    transcendentals = steps * (s + c // s) * c * k
    bytes_accessed = steps * (2 * c * k * itemsize + c * k * 4 + c * 4 + 2 * c * c * 4)
    return pl.CostEstimate(flops=flops, transcendentals=transcendentals, bytes_accessed=bytes_accessed)


def launch_intra(q, k, g, beta, config: KernelConfig):
    """(Tinv, Aqk) for every chunk.

    Args:
      q, k: [B, Tp, H*K] input dtype (token-major, `layout.to_tokens`; K a multiple of 128).
      g: [B, Tp, HV*K] float32 raw per-step log decays.
      beta: [B, HV, NT, 1, C] float32.
    Returns:
      tinv, aqk: [B, HV, Tp, C] float32.
      Under `jax.vmap` the mapped axis folds into B (`gla_core.pallas_transforms.fold_vmap`).
    """
    launch = functools.partial(_launch_intra, config=config)
    return fold_vmap(launch, (q, k, g, beta), in_axes=(0,) * 4, out_axes=0)


def _launch_intra(q, k, g, beta, *, config: KernelConfig):
    batch, heads = beta.shape[:2]
    padded_len, key_dim = g.shape[1], g.shape[2] // heads
    c = config.blocks.chunk_size
    num_chunks = padded_len // c
    per_step = config.blocks.per_step(num_chunks)
    rows = per_step * c
    qk_spec = token_block(rows, key_dim, config.group)
    out_spec = pl.BlockSpec((None, None, rows, c), head_index)
    out_shape = jax.ShapeDtypeStruct((batch, heads, padded_len, c), jnp.float32)
    with jax.named_scope("kda_intra"):
        return pl.pallas_call(
            functools.partial(intra_kernel, config=config),
            grid=(batch, heads, num_chunks // per_step),
            in_specs=[
                qk_spec,
                qk_spec,
                token_block(rows, key_dim),
                pl.BlockSpec((None, None, per_step, 1, c), beta_index),
            ],
            out_specs=[out_spec, out_spec],
            out_shape=[out_shape, out_shape],
            compiler_params=compiler_params(sequential_time=False),
            cost_estimate=intra_cost(
                batch, heads, num_chunks, c, key_dim, config.blocks.sub_chunk, config.mxu_dtype.itemsize
            ),
            interpret=config.interpret_arg,
            name="kda_intra",
        )(q, k, g, beta)
