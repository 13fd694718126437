"""Forward intra-chunk kernel: the WY inverse (I + Akk)^-1 and the attention Aqk of every chunk.

Per chunk (C tokens of the user's q/k/g, read in place through token-major views, G the
within-chunk cumsum of the cleaned decay, `chunk_math.clean_log_decay`):
  Akk_ij = beta_i sum_d k_id k_jd exp(G_id - G_jd)          j < i   (strictly lower)
  Tinv   = (I + Akk)^-1                                       (recursively blocked inverse)
  Aqk_ij = scale sum_d q_id k_jd exp(G_id - G_jd)           j <= i
The gated products are gla-core's (`gla_core.chunk.products`), for all n chunks of the step:
one matrix product each from the anchored factors e^{+-D}; where a step's anchored exponents leave
the anchor range (`KernelConfig.anchor`), recomputed exact between sub-blocks of 16 steps and
anchored inside them (`BlockedProducts`, log2(C/16) + 1 products); where even a sub-block leaves
it (or without an anchor range), exactly with the level products (every exponent <= 0).
Every chunk is independent: the grid (B, HV, NT) is parallel on all axes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_core.kit import (
    KERNEL_VMEM_BUDGET_BYTES,
    AnchoredProducts,
    LevelProducts,
    StepDecays,
    fold_vmap,
    intra_costs,
    mask_table_inputs,
    recompute_products,
    row_to_column,
)
from gla_kda.pallas import chunk_math as cm
from gla_kda.pallas import poison as nf
from gla_kda.pallas.config import KernelConfig, compiler_params, head_block, token_block


def intra_kernel(q_ref, k_ref, g_ref, beta_ref, table_ref, tinv_ref, aqk_ref, kk_ref, *, config: KernelConfig):
    """Blocks of n chunks: q, k [n*C, K] input dtype (non-finite entries read as 0); g [n*C, K] raw
    per-step log decays (cleaned here, `chunk_math.clean_log_decay`); beta [n, 1, C] (non-finite
    entries read as 0); table:
    gla-core's `KeyMaskTable`; outputs tinv and aqk [n*C, C] in `config.store_dtype` (every reader
    multiplies them in the matrix-unit dtype, so storing them rounded to it changes no result);
    scratch kk [n*C, C] float32.

    The gated products take the first form valid for the step: anchored at each chunk's middle row,
    else exact between sub-blocks and anchored inside them (`BlockedProducts`, valid for decays
    C/s times stronger), else the exact level products. The first pass takes q, k and g as they
    are; a step out of the anchor range or with a non-finite q, k or g (`poison.StepFlags`) is
    recomputed from the cleaned inputs and solves its inverses again from kk. The chunks are
    independent; their (I + Akk)^-1 are solved together (`unit_lower_inverses`, diagonal blocks of
    `BlockSizes.inverse_block` rows) so that their serial chains interleave.
    """
    c, n = config.blocks.chunk_size, beta_ref.shape[0]
    dtype = config.mxu_dtype
    raw_q, raw_k, raw_g = q_ref[...], k_ref[...], g_ref[...]

    def kk_and_write_aqk(products, q, k):
        """Writes Aqk of q, k [n*C, K] float32 (q scaled) and returns the gated k k^T products kk
        [n, C, C] of `products`."""
        q, k = q.reshape(n, c, -1), k.reshape(n, c, -1)
        kk = products.scores(k, k)
        aqk_ref[...] = products.scores(q, k).reshape(n * c, c).astype(aqk_ref.dtype)
        return kk

    def write_inverses(kk):
        """Tinv of every chunk from its gated k k^T products kk [n, C, C]."""
        strict = cm.lower_mask(c, strict=True)
        akks = [jnp.where(strict, row_to_column(cm.finite(beta_ref[i])) * kk[i], 0.0) for i in range(n)]
        blocks = cm.SubBlocks(c, config.blocks.inverse_block)
        for i, tinv in enumerate(cm.unit_lower_inverses(akks, blocks, config.unroll, dtype)):
            tinv_ref[pl.ds(i * c, c), :] = tinv.astype(tinv_ref.dtype)

    # The first pass takes q, k and g as they are (g raised to its floor), the same as cleaned where
    # they are finite, and keeps kk in values so that the inverse overlaps the products.
    flags = nf.StepFlags()
    for x in (raw_q, raw_k):
        flags.add_values(x)
    flags.add_log_decays(raw_g)
    q, k = raw_q.astype(jnp.float32) * config.scale, raw_k.astype(jnp.float32)
    a = cm.floor_log_decay(raw_g)
    again = flags.any()
    if config.anchor is None:
        write_inverses(kk_and_write_aqk(LevelProducts(a, table_ref, c, dtype), q, k))
    else:
        decays = StepDecays(a, table_ref, c, config.anchor, scores_only=True)
        write_inverses(kk_and_write_aqk(AnchoredProducts(decays, dtype), q, k))
        again = again | jnp.logical_not(decays.in_range)

    @pl.when(again)
    def _recompute():
        """A step with a non-finite q, k or g, or out of the anchor range: again from the cleaned
        inputs, with the first valid of `BlockedProducts` and `LevelProducts`. libtpu's static
        estimate charges only the first pass."""
        clean_q, clean_k = cm.finite(raw_q) * config.scale, cm.finite(raw_k)
        clean_a = cm.clean_log_decay(raw_g)

        def write_products(products):
            kk_ref[...] = kk_and_write_aqk(products, clean_q, clean_k).reshape(n * c, c)

        if config.anchor is None:
            write_products(LevelProducts(clean_a, table_ref, c, dtype))
        else:
            recompute_products(clean_a, table_ref, c, config.anchor, dtype, write_products)
        write_inverses(kk_ref[...].reshape(n, c, c))


def intra_cost(batch, heads, num_chunks, c, k, s, itemsize):
    """Flops and bytes of `intra_kernel` over the whole grid: the two anchored gated products (gla-core's
    `intra_costs`) and the blocked inverse."""
    steps = batch * heads * num_chunks
    gate_flops, gate_transcendentals = intra_costs("key", c, k, products=2, anchored=True)
    flops = steps * (gate_flops + cm.unit_lower_inverse_flops(c, s))
    transcendentals = steps * gate_transcendentals
    bytes_accessed = steps * (2 * c * k * itemsize + c * k * 4 + c * 4 + c * c * (4 + itemsize))
    return pl.CostEstimate(flops=flops, transcendentals=transcendentals, bytes_accessed=bytes_accessed)


def launch_intra(q, k, g, beta, config: KernelConfig):
    """(Tinv, Aqk) for every chunk.

    Args:
      q, k: [B, Tp, H*K] input dtype (token-major, `layout.to_tokens`; K a multiple of 128).
      g: [B, Tp, HV*K] float32 raw per-step log decays.
      beta: [B, HV, NT, 1, C] float32.
    Returns:
      tinv, aqk: [B, HV, Tp, C] in `config.store_dtype`.
      Under `jax.vmap` the mapped axis folds into B (`gla_core.pallas_transforms.fold_vmap`).
    """
    launch = functools.partial(_launch_intra, config=config)
    return fold_vmap(launch, (q, k, g, beta), in_axes=(0,) * 4, out_axes=0)


def _launch_intra(q, k, g, beta, *, config: KernelConfig):
    batch, heads = beta.shape[:2]
    padded_len, key_dim = g.shape[1], g.shape[2] // heads
    c = config.blocks.chunk_size
    num_chunks = padded_len // c
    per_step = config.blocks.per_step(num_chunks, config.blocks.intra_chunks_per_step)
    rows = per_step * c
    qk_spec = token_block(rows, key_dim, config.group)
    table, table_spec = mask_table_inputs("key", c)
    out_spec = head_block(rows, c)
    tinv_shape = jax.ShapeDtypeStruct((batch, heads, padded_len, c), config.store_dtype)
    aqk_shape = jax.ShapeDtypeStruct((batch, heads, padded_len, c), config.store_dtype)
    with jax.named_scope("kda_intra"):
        return pl.pallas_call(
            functools.partial(intra_kernel, config=config),
            grid=(batch, heads, num_chunks // per_step),
            in_specs=[
                qk_spec,
                qk_spec,
                token_block(rows, key_dim),
                head_block(per_step, 1, c),
                *table_spec,
            ],
            out_specs=[out_spec, out_spec],
            out_shape=[tinv_shape, aqk_shape],
            scratch_shapes=[pltpu.VMEM((rows, c), jnp.float32)],
            compiler_params=compiler_params(sequential_time=False, vmem_limit_bytes=KERNEL_VMEM_BUDGET_BYTES),
            cost_estimate=intra_cost(
                batch, heads, num_chunks, c, key_dim, config.blocks.inverse_block, config.mxu_dtype.itemsize
            ),
            interpret=config.interpret_arg,
            name="kda_intra",
        )(q, k, g, beta, *table)
