"""Forward output kernel: o = scale (q exp(G)) S + Aqk delta for every chunk (parallel grid).

S is the state before the chunk (from the state kernel), delta its v_new, Aqk the scaled,
decayed causal attention of the intra kernel (scale already inside).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_core.kit import fold_vmap
from gla_kda.pallas import chunk_math as cm
from gla_kda.pallas import poison as nf
from gla_kda.pallas.config import KernelConfig, compiler_params, head_block, token_block


def output_kernel(q_ref, g_ref, h_ref, delta_ref, aqk_ref, poison_ref, o_ref, *, config: KernelConfig):
    """Blocks of n chunks: q [n*C, K]; g [n*C, K] raw per-step log decays; h [n*K, V];
    delta [n*C, V]; aqk [n*C, C]; poison rows [n*8, V] (`gla_kda.pallas.poison`); output o
    [n*C, V], NaN where the recurrence's is not finite."""
    c, key_dim = config.blocks.chunk_size, q_ref.shape[-1]
    sb = cm.SubBlocks(c, config.blocks.sub_chunk)
    for n in range(h_ref.shape[0] // key_dim):
        rows = pl.ds(n * c, c)
        raw_q = q_ref[rows, :]
        # q is not cleaned: a non-finite q_t only reaches row t, which is poisoned anyway.
        q = raw_q.astype(cm.F32) * config.scale
        decayed_q = q * jnp.exp(cm.Decays.of_steps(g_ref[rows, :], sb, compensated=False).cum)
        inter = cm.dot(decayed_q, h_ref[pl.ds(n * key_dim, key_dim), :], config.mxu_dtype)
        intra = cm.dot(aqk_ref[rows, :], delta_ref[rows, :], config.mxu_dtype)
        o = nf.poison_chunk(inter + intra, poison_ref, n, raw_q)
        o_ref[rows, :] = o.astype(o_ref.dtype)


def output_cost(batch, heads, num_chunks, c, k, v, dtype, out_dtype):
    itemsize, out_itemsize = jnp.dtype(dtype).itemsize, jnp.dtype(out_dtype).itemsize
    steps = batch * heads * num_chunks
    flops = steps * (2 * c * k * v + 2 * c * c * v)
    bytes_accessed = steps * (c * k * itemsize + c * k * 4 + (k * v + c * v + c * c) * itemsize + c * v * out_itemsize)
    return pl.CostEstimate(flops=flops, transcendentals=steps * c * k, bytes_accessed=bytes_accessed)


def launch_output(q, g, h, delta, aqk, poison_rows, config: KernelConfig, out_dtype):
    """o [B, Tp, HV*V] in `out_dtype` (token-major: `layout.from_tokens` gives [B, T, HV, V]).

    Args:
      q: [B, Tp, H*K] (token-major, K a multiple of 128); g: [B, Tp, HV*K] float32 raw per-step
      log decays;
      h: [B, NT*K, HV*V] (rows n*K.. the state before chunk n, lanes j*V.. value head j) and
      delta: [B, Tp, HV*V] (token-major), both from `state.launch_state`; aqk: [B, HV, Tp, C] (`launch_intra`);
      poison_rows: [B, NT*8, HV*V] float32 (`gla_kda.pallas.poison`).
      Under `jax.vmap` the mapped axis folds into B (`gla_core.pallas_transforms.fold_vmap`).
    """
    launch = functools.partial(_launch_output, config=config, out_dtype=out_dtype)
    return fold_vmap(launch, (q, g, h, delta, aqk, poison_rows), in_axes=(0,) * 6, out_axes=0)


def _launch_output(q, g, h, delta, aqk, poison_rows, *, config: KernelConfig, out_dtype):
    batch, heads, padded_len = aqk.shape[:3]
    key_dim, value_dim = g.shape[2] // heads, delta.shape[2] // heads
    c = config.blocks.chunk_size
    num_chunks = padded_len // c
    per_step = config.blocks.per_step(num_chunks)
    rows = per_step * c
    with jax.named_scope("kda_output"):
        return pl.pallas_call(
            functools.partial(output_kernel, config=config),
            grid=(batch, heads, num_chunks // per_step),
            in_specs=[
                token_block(rows, key_dim, config.group),
                token_block(rows, key_dim),
                token_block(per_step * key_dim, value_dim),
                token_block(rows, value_dim),
                head_block(rows, c),
                token_block(per_step * nf.ROWS_PER_CHUNK, value_dim),
            ],
            out_specs=token_block(rows, value_dim),
            out_shape=jax.ShapeDtypeStruct((batch, padded_len, heads * value_dim), out_dtype),
            compiler_params=compiler_params(sequential_time=False),
            cost_estimate=output_cost(batch, heads, num_chunks, c, key_dim, value_dim, config.mxu_dtype, out_dtype),
            interpret=config.interpret_arg,
            name="kda_output",
        )(q, g, h, delta, aqk, poison_rows)
