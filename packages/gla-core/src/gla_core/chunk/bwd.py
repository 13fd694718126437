"""`chunk_bwd`: the whole backward of a per-key gate in one kernel, walking time backwards.

With `S_c` the state before chunk c (kept by the forward, `chunk_fwd(keep_states=True)`), `A` the
intra-chunk scores it kept and `G_c` the gradient of the state after the chunk, carried in VMEM:

    G_{c-1} = diag(e^{b_L}) G_c + scale * sum_t (q_t * e^{b_t}) do_t^T          (as `chunk_bwd_dh`)
    dv_s    = (k_s * e^{b_L - b_s}) G_c + scale * sum_{t>=s} A_ts do_t             (as `chunk_bwd_dv`)
    dq, dk, d loss / d a from S_c and G_c                                        (as `chunk_bwd_dqkg`)

so the state gradients never leave VMEM and the states are read once, where the split backward
recomputes the states (`chunk_fwd_h`), writes every state gradient (`chunk_bwd_dh`) and reads both
again. `G` is reset to the final-state gradient `dht[seq]` (or zero) at the last chunk of every
sequence, and `dh0[seq]` is written after its first chunk (packed sequences starting and ending
inside a grid step: `packed`).

A grid step takes its n chunks together (`step_math`): the state-gradient chain is elementwise,
dv is exact, and dq, dk and the gate gradient take the anchored products; a step out of the
anchor range recomputes those three with the blocked products, or the exact level products where
even a sub-block is out of range (`products.recompute_products`; the level products every step
when the anchor range is 0). The grid is (B, H, 1, NT / n),
time "arbitrary" and walked backwards, with all of K and V in every block
(`ChunkSpecs.value_tiled` with one V tile).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_core.chunk.anchored import StepDecays
from gla_core.chunk.batched import chunk_rows, gate_rows, load_per_chunk, store_chunk_rows, store_gate_rows
from gla_core.chunk.common import mxu_dtype
from gla_core.chunk.gates import intra_costs
from gla_core.chunk.launch import carry_in_step, sequential_call
from gla_core.chunk.packed import ChainEdges
from gla_core.chunk.specs import ChunkSpecs
from gla_core.chunk.step_math import backward_step, run_gradients
from gla_core.pallas_transforms import fold_vmap


def _bwd_kernel(
    first_ref,
    last_ref,
    seq_ref,
    *refs,
    has_dht,
    has_dh0,
    scale,
    num_chunks,
    dtype,
    chunk,
    chunks_per_step,
    anchor_range,
    packed,
):
    q_ref, k_ref, v_ref, do_ref = refs[:4]  # [n*C, K], [n*C, K], [n*C, V], [n*C, V]
    gate_ref = refs[4]  # float32 [n*C, K] ("key" mode) or [n*C / 128, 128] ("broadcast")
    h_ref, scores_ref = refs[5:7]  # [n, V, K] float32, [n, C, C] ([V, K], [C, C] for n = 1)
    dht_ref = refs[7] if has_dht else None  # [V, K] (packed: [N, H, V, K] in HBM)
    table_ref = refs[7 + has_dht]  # the key mask table
    dq_ref, dk_ref, dv_ref, da_ref = refs[8 + has_dht : 12 + has_dht]  # time rows of q, k, v, gate
    dh0_ref = refs[12 + has_dht] if has_dh0 else None  # [V, K] (packed: [N, H, V, K] in HBM)
    grad_ref = refs[-1]  # VMEM scratch [V, K] float32: the gradient of the state after the step
    n = chunks_per_step
    walked = pl.program_id(3) * n  # chunks after this step's
    last_chunk = num_chunks - 1 - walked
    carry_in_step(grad_ref, walked, last_ref[last_chunk] == 1, dht_ref, packed is not None)
    edges = None
    if packed is not None:  # walking backwards, a sequence starts at its last chunk and ends at its first
        edges = ChainEdges(packed.states(last_ref, first_ref, seq_ref, dht_ref, dh0_ref), grad_ref, last_chunk - n + 1)
    a = gate_rows(gate_ref, *q_ref.shape)  # [n*C, K]
    decays = StepDecays(a, table_ref, chunk, anchor_range if anchor_range > 0 else None)
    q, k = chunk_rows(q_ref, n, jnp.float32), chunk_rows(k_ref, n, jnp.float32)  # [n, C, K]
    v, do = chunk_rows(v_ref, n), chunk_rows(do_ref, n)  # [n, C, V]
    states = load_per_chunk(h_ref, n)  # [n, V, K]
    scores = load_per_chunk(scores_ref, n)
    step = backward_step(decays, q, k, do, scores, grad_ref[...][None], scale=scale, dtype=dtype, edges=edges)
    grad_ref[...] = step.end[0]
    store_chunk_rows(dv_ref, step.dv)

    if has_dh0 and edges is None:

        @pl.when(first_ref[last_chunk - n + 1] == 1)
        def _initial():
            dh0_ref[...] = step.end[0]

    operands = (a.reshape(q.shape), q, k, v, do, states, step.grads, table_ref)

    def write(dq, dk, da):
        store_chunk_rows(dq_ref, dq)
        store_chunk_rows(dk_ref, dk)
        store_gate_rows(da_ref, da)

    run_gradients(decays, a, table_ref, operands, write, scale=scale, dtype=dtype, chunk=chunk)


def fits(specs: ChunkSpecs) -> bool:
    """Whether `chunk_bwd` can serve a call of these (value-tiled) specs: a per-key gate (or a scalar
    gate in "broadcast" mode), with all of K and V in one block."""
    return specs.per_step and specs.num_tiles == 1


def chunk_bwd(
    q,
    k,
    v,
    do,
    gate,
    h,
    scores,
    dht,
    meta,
    *,
    specs: ChunkSpecs,
    scale: float,
    need_dh0: bool,
    anchor_range: float,
    interpret: bool,
):
    """dq, dk, dv, the gate gradient and the initial-state gradients of a per-key gate (or of a
    scalar gate in "broadcast" mode).

    Args:
      q, k: [B, H, Tp, K]; v, do: [B, H, Tp, V]; gate: float32 per-step log decays, [B, H, Tp, K]
        ("key" mode) or [B, H, NT / n, n*C / 128, 128] ("broadcast");
      h: [B, H, NT, V, K] float32, the state before every chunk (`chunk_fwd(keep_states=True)`);
      scores: [B, H, 1, NT, C, C], the forward's intra-chunk scores;
      dht: [N, H, V, K] float32 gradient of the final states, or None (zero).
      meta: `ChunkMeta`; specs: reversed value-tiled specs with one V tile (`fits`).
      need_dh0: also return the initial-state gradients.
      anchor_range: the largest |D| of the anchored products (`anchored.StepDecays`); 0 takes the
        exact level products everywhere.

    Returns:
      (dq, dk [B, H, Tp, K] in q's dtype, dv [B, H, Tp, V] in v's dtype, d/da float32 in the
      gate's shape ("broadcast" mode: summed over the keys), dh0 [N, H, V, K] float32 or None).
      Under `jax.vmap` the mapped axis folds into B and N (`gla_core.pallas_transforms.fold_vmap`).
    """
    if not (specs.reverse and fits(specs)):
        raise ValueError("chunk_bwd needs reverse-time value-tiled specs of a per-key gate with one V tile")
    launch = functools.partial(
        _launch, specs=specs, scale=scale, need_dh0=need_dh0, anchor_range=anchor_range, interpret=interpret
    )
    args = (q, k, v, do, gate, h, scores, dht, meta.first, meta.last, meta.sequence)
    return fold_vmap(launch, args, in_axes=(0,) * 8 + (None,) * 3, out_axes=0)


def _launch(
    q, k, v, do, gate, h, scores, dht, first, last, sequence, *, specs, scale, need_dh0, anchor_range, interpret
):
    b, hh, _, kdim = q.shape
    vdim = v.shape[-1]
    nt, c = specs.num_chunks, specs.chunk
    kernel = functools.partial(
        _bwd_kernel,
        has_dht=dht is not None,
        has_dh0=need_dh0,
        scale=scale,
        num_chunks=nt,
        dtype=mxu_dtype(q.dtype),
        chunk=c,
        chunks_per_step=specs.chunks_per_step,
        anchor_range=anchor_range,
        packed=specs.packed_layout(),
    )
    gate_flops, transcendentals = intra_costs("key", c, kdim, products=2, anchored=True)
    # per chunk: the state-gradient update, dv (from the state gradient and the scores), dq/dk inter,
    # dq/dk/dgate intra and the two triangular sums of the gate gradient
    per_chunk = 2 * c * kdim * vdim * 4 + 2 * c * c * vdim * 2 + 2 * 3 * 2 * c * c * kdim
    outputs = [
        (jax.ShapeDtypeStruct(q.shape, q.dtype), specs.key()),
        (jax.ShapeDtypeStruct(k.shape, k.dtype), specs.key()),
        (jax.ShapeDtypeStruct(v.shape, v.dtype), specs.value()),
        (jax.ShapeDtypeStruct(gate.shape, jnp.float32), specs.gate()),
    ]
    in_specs = [specs.key(), specs.key(), specs.value(), specs.value(), specs.gate()]
    in_specs += [specs.chunk_state(), specs.chunk_scores()]
    (dq, dk, dv, da), dh0 = sequential_call(
        "chunk_bwd",
        kernel,
        [q, k, v, do, gate, h, scores],
        in_specs,
        dht,
        (first, last, sequence),
        outputs,
        specs=specs,
        state_out=need_dh0,
        flops=b * hh * nt * (gate_flops + per_chunk),
        transcendentals=b * hh * nt * transcendentals,
        interpret=interpret,
    )
    return dq, dk, dv, da, dh0
