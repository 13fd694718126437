"""`chunk_bwd_dqkg`: query, key and gate gradients of every chunk.

With `S_c` the state before the chunk, `G_c` the gradient of the state after it and
`dA_ts = do_t . v_s`:

    dq_t = scale * ( e^{b_t} * (S_c do_t) + sum_{s<=t} dA_ts k_s e^{b_t - b_s} )
    dk_s = e^{b_L - b_s} * (G_c v_s) + scale * sum_{t>=s} dA_ts q_t e^{b_t - b_s}
    d loss / d b_t = q_t * dq_t - k_t * dk_t
                     + [t = L] ( sum_s k_s * e^{b_L - b_s} * (G_c v_s) + e^{b_L} * rowsum(S_c * G_c) )

(per key for gk, summed over keys for scalar gates), and the gradient of the per-step gate
is `d loss / d a_u = sum_{t>=u} d loss / d b_t`, formed in the kernel by triangular matmuls
without the terms that cancel exactly (see the kernel). The grid is (B, H, NK, NT), all
parallel, with all of V in every block.

Per-key gates take a grid step at a time (`_step_kernel`, `step_math.gradients`): every chunk of
the step together, with the anchored products; a step whose decays are out of the anchor range
is recomputed with the blocked products, or the exact level products where even a sub-block is
out of range (`products.recompute_products`; the level products every step when the anchor range
is 0). The chunk-by-chunk `_bwd_dqkg_kernel` serves scalar gates.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_core.chunk.anchored import StepDecays
from gla_core.chunk.batched import chunk_rows, load_per_chunk, store_chunk_rows
from gla_core.chunk.common import (
    NN,
    NT,
    chunk_iota,
    compiler_params,
    cost_estimate,
    dot,
    mxu_dtype,
)
from gla_core.chunk.gates import ScalarGate, intra_costs, mask_table_inputs
from gla_core.chunk.launch import for_each_chunk
from gla_core.chunk.specs import ChunkSpecs
from gla_core.chunk.step_math import run_gradients
from gla_core.pallas_transforms import fold_vmap
from gla_core.tpu import interpret_params


def chunk_gradients(gate, q, k, v, do, state, grad, *, scale, dtype):
    """dq, dk `[C, K]` and d loss / d a `[1, C]`, float32, of one chunk of a scalar gate.

    Args:
      gate: the chunk's `gates.ScalarGate`.
      q, k: `[C, K]`; v, do: `[C, V]`; state, grad: `[V, K]` float32, the state before the chunk and
      the gradient of the state after it.
    """
    chunk = q.shape[0]
    rows, cols = chunk_iota(chunk)
    d_scores = dot(do, v, NT, dtype)  # [C, C]
    d_diagonal = jnp.sum(jnp.where(rows == cols, d_scores, 0.0), axis=1, keepdims=True)  # [C, 1]
    q_strict, k_strict = gate.left_right_strict(jnp.where(rows > cols, d_scores, 0.0), k, q)
    dq_inter = dot(do, state, NN, dtype) * gate.from_start()  # [C, K]
    dk_inter = dot(v, grad, NN, dtype) * gate.to_end()  # [C, K]
    q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
    dq = scale * (dq_inter + q_strict + d_diagonal * k32)
    dk = dk_inter + scale * (k_strict + d_diagonal * q32)
    # d loss / d a_u sums d loss / d b_t over t >= u. Summed that way, pairs of terms that cancel
    # exactly (the diagonal t = s of q*dq and k*dk; k_s * dk_inter_s at step s and at the chunk
    # end) would leave rounding noise far above the small gate gradient of fast decays, so each
    # term is summed only over the u it reaches: k_s * dk_inter_s reaches u > s.
    after = scale * (q32 * (dq_inter + q_strict) - k32 * k_strict)
    total = gate.last_decay() * jnp.sum(state * grad, axis=0, keepdims=True)  # [1, K]
    return dq, dk, gate.gate_grad(after, k32 * dk_inter, total)


def _bwd_dqkg_kernel(q_ref, k_ref, v_ref, do_ref, gate_ref, h_ref, dh_ref, dq_ref, dk_ref, da_ref, *, scale, dtype):
    # q, k [C, Kt]; v, do [C, V]; gate [1, C]; h, dh [V, Kt] float32; dq, dk [C, Kt];
    # da [1, C] float32 (this K tile's partial sum)
    gate = ScalarGate(gate_ref[...], dtype)
    dq, dk, da = chunk_gradients(
        gate, q_ref[...], k_ref[...], v_ref[...], do_ref[...], h_ref[...], dh_ref[...], scale=scale, dtype=dtype
    )
    da_ref[...] = da
    dq_ref[...] = dq.astype(dq_ref.dtype)
    dk_ref[...] = dk.astype(dk_ref.dtype)


def _step_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    gate_ref,
    h_ref,
    dh_ref,
    table_ref,
    dq_ref,
    dk_ref,
    da_ref,
    *,
    scale,
    dtype,
    chunk,
    chunks_per_step,
    anchor_range,
):
    # q, k [n*C, Kt]; v, do [n*C, V]; gate [n*C, Kt] float32; h, dh [n, V, Kt] ([V, Kt] for n = 1)
    # float32; the key mask table; dq, dk [n*C, Kt]; da [n*C, Kt] float32
    n = chunks_per_step
    a = gate_ref[...]
    decays = StepDecays(a, table_ref, chunk, anchor_range if anchor_range > 0 else None)
    operands = (
        chunk_rows(gate_ref, n),
        chunk_rows(q_ref, n, jnp.float32),
        chunk_rows(k_ref, n, jnp.float32),
        chunk_rows(v_ref, n),
        chunk_rows(do_ref, n),
        load_per_chunk(h_ref, n),
        load_per_chunk(dh_ref, n),
        table_ref,
    )

    def write(dq, dk, da):
        store_chunk_rows(dq_ref, dq)
        store_chunk_rows(dk_ref, dk)
        store_chunk_rows(da_ref, da)

    run_gradients(decays, a, table_ref, operands, write, scale=scale, dtype=dtype, chunk=chunk)


def chunk_bwd_dqkg(
    q,
    k,
    v,
    do,
    gate,
    h,
    dh,
    *,
    specs: ChunkSpecs,
    scale: float,
    interpret: bool,
    float32_products: bool = False,
    anchor_range: float = 0.0,
):
    """Query, key and gate gradients.

    Args:
      q, k: [B, H, Tp, K]; v, do: [B, H, Tp, V]; gate: as in `chunk_fwd_h`;
      h: [B, H, NT, V, K] states before every chunk; dh: [B, H, NT, V, K] gradients of the
      states after every chunk (both float32).
      specs: K-tiled ChunkSpecs (`key_tiled`).
      float32_products: multiply in float32 even for bfloat16 inputs. For a gate gradient that is
        summed over many steps (d g_gamma = sum over B and T of d/da): the sum cancels to a small
        part of its terms, so the rounding of the states and scores to bfloat16 for the MXU,
        harmless per step, would dominate it.

    Returns:
      (dq [B, H, Tp, K], dk [B, H, Tp, K] in q's dtype, d/da float32): d/da is [B, H, Tp, K]
      for a per-key gate and [B, H, NK, NT, 1, C] for a scalar gate (one partial sum over
      the keys of each of the NK key tiles; the caller sums them). Under `jax.vmap` the mapped
      axis folds into B (`gla_core.pallas_transforms.fold_vmap`).
    """
    if specs.tiled != "k":
        raise ValueError("chunk_bwd_dqkg needs K-tiled specs with all of V in a block (ChunkSpecs.key_tiled)")
    if specs.gate_mode == "broadcast":
        raise ValueError('chunk_bwd_dqkg serves gate modes "scalar" and "key", got "broadcast" (see bwd.chunk_bwd)')
    dtype = jnp.float32 if float32_products else mxu_dtype(q.dtype)
    launch = functools.partial(
        _launch, specs=specs, scale=scale, dtype=dtype, anchor_range=anchor_range, interpret=interpret
    )
    return fold_vmap(launch, (q, k, v, do, gate, h, dh), in_axes=(0,) * 7, out_axes=0)


def _launch(q, k, v, do, gate, h, dh, *, specs: ChunkSpecs, scale: float, dtype, anchor_range: float, interpret: bool):
    b, hh, tp, kdim = q.shape
    vdim = v.shape[-1]
    nk, nt, c = specs.num_tiles, specs.num_chunks, specs.chunk
    if specs.gate_mode == "key":
        gate_grad_shape, gate_grad_spec = jax.ShapeDtypeStruct(gate.shape, jnp.float32), specs.key()
    else:
        gate_grad_shape = jax.ShapeDtypeStruct((b, hh, nk, nt, 1, c), jnp.float32)
        gate_grad_spec = specs.scalar_gate_partial()
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype), gate_grad_shape]
    table, table_spec = mask_table_inputs(specs.gate_mode, c)
    anchored = specs.gate_mode == "key" and anchor_range > 0
    if specs.gate_mode == "key":
        kernel = functools.partial(
            _step_kernel,
            scale=scale,
            dtype=dtype,
            chunk=c,
            chunks_per_step=specs.chunks_per_step,
            anchor_range=anchor_range,
        )
    else:
        kernel = functools.partial(_bwd_dqkg_kernel, scale=scale, dtype=dtype)
        kinds = "rrrrccc" + "rrc"
        kernel = for_each_chunk(kernel, specs, kinds)
    flops, transcendentals = intra_costs(specs.gate_mode, c, specs.block_k, products=2, anchored=anchored)
    flops = b * hh * nk * nt * flops + b * hh * (6 * tp * kdim * vdim + 2 * tp * c * vdim * nk)
    with jax.named_scope("chunk_bwd_dqkg"):
        return pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=specs.grid(b, hh),
            in_specs=[
                specs.key(),
                specs.key(),
                specs.value(),
                specs.value(),
                specs.gate(),
                specs.chunk_state(),
                specs.chunk_state(),
                *table_spec,
            ],
            out_specs=[specs.key(), specs.key(), gate_grad_spec],
            compiler_params=compiler_params("parallel", "parallel", "parallel", "parallel"),
            interpret=interpret_params(interpret),
            cost_estimate=cost_estimate(
                flops, b * hh * nk * nt * transcendentals, [q, k, v, do, gate, h, dh, *out_shape]
            ),
            name="chunk_bwd_dqkg",
        )(q, k, v, do, gate, h, dh, *table)
