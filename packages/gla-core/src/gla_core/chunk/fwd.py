"""`chunk_fwd`: the forward in one pass, the state carried in VMEM along the sequential time axis.

Per chunk c (b_t the sum of the chunk's log decays through step t, L its last step, S_c the
state before the chunk, stored transposed `[V, K]`):

    o_t     = scale * ( (q_t * e^{b_t}) S_c  +  sum_{s<=t} (sum_k q_tk k_sk e^{b_tk - b_sk}) v_s )
    S_{c+1} = diag(e^{b_L}) S_c + sum_t (k_t * e^{b_L - b_t}) v_t^T

with the state reset to `initial_state[seq]` at the first chunk of every sequence and the final
state written at its last chunk (scalar-prefetched per-chunk metadata, see `prepare.ChunkMeta`).
The states never leave VMEM; the backward recomputes them with `chunk_fwd_h`. `scale`
multiplies the float32 accumulations (q is never pre-scaled). For the backward the forward can
also keep every chunk's intra-chunk scores `A[t, s] = sum_k q_tk k_sk e^{b_tk - b_sk}` (s <= t,
unscaled), in the MXU dtype they are multiplied in, so `chunk_bwd_dv` takes `A^T do` without
forming the gated products again.

Per-key gates take a grid step at a time (`_anchored_step_kernel`): every chunk of the step
together, with the anchored products of `anchored.StepDecays` and the state chain reduced to
elementwise updates; a step whose decays are out of the anchor range, or whose states come out
non-finite (a non-finite k or v, which the unmasked products would carry into earlier rows), is
recomputed chunk by chunk from its first state by `_fwd_kernel` (exact level products, masked).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_core.chunk.anchored import StepDecays
from gla_core.chunk.batched import causal_mask, chunk_rows, state_chain, store_chunk_rows, store_per_chunk
from gla_core.chunk.common import BATCHED_NN, BATCHED_NT, BATCHED_TN, NT, TN, causal_dot, dot, mxu_dtype
from gla_core.chunk.gates import make_gate
from gla_core.chunk.launch import carry_in, launch_output_pass, step_edges
from gla_core.chunk.specs import ChunkSpecs
from gla_core.pallas_transforms import fold_vmap


def _fwd_kernel(
    first_ref,
    last_ref,
    seq_ref,
    *refs,
    gate_mode,
    has_h0,
    has_ht,
    has_scores,
    scale,
    dtype,
    chunks_per_step,
    chunk_in_step,
):
    q_ref, k_ref, v_ref, gate_ref = refs[:4]  # [C, K], [C, K], [C, Vt], [1, C] or [C, K]
    h0_ref = refs[4] if has_h0 else None  # [Vt, K]
    has_table = gate_mode == "key"
    table = refs[4 + has_h0 : 4 + has_h0 + has_table]  # the key mask table, if any
    outs = refs[4 + has_h0 + has_table :]
    o_ref = outs[0]  # [C, Vt]
    scores_ref = outs[1] if has_scores else None  # [C, C]
    ht_ref = outs[1 + has_scores] if has_ht else None  # [Vt, K]
    state_ref = refs[-1]  # VMEM scratch [Vt, K] float32
    t = pl.program_id(3) * chunks_per_step + chunk_in_step  # the chunk
    opens_step, closes_step = step_edges(chunk_in_step, chunks_per_step)
    if opens_step:
        carry_in(state_ref, t, first_ref[t] == 1, h0_ref)
    state = state_ref[...]
    gate = make_gate(gate_mode, gate_ref[...], dtype, *table, products=True)
    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    inter = dot(q.astype(jnp.float32) * gate.from_start(), state, NT, dtype)  # [C, Vt]
    scores = gate.scores(q, k)  # [C, C]
    if has_scores:
        scores_ref[...] = scores.astype(scores_ref.dtype)
    intra = causal_dot(scores, v, dtype)  # a non-finite v_s reaches rows t >= s only
    o_ref[...] = (scale * (inter + intra)).astype(o_ref.dtype)
    k_decayed = k.astype(jnp.float32) * gate.to_end()  # [C, K]
    state = state * gate.last_decay() + dot(v, k_decayed, TN, dtype)
    state_ref[...] = state

    if has_ht and closes_step:

        @pl.when(last_ref[t] == 1)
        def _final():
            ht_ref[...] = state


def _anchored_step_kernel(
    first_ref,
    last_ref,
    seq_ref,
    *refs,
    has_h0,
    has_ht,
    has_scores,
    scale,
    dtype,
    chunk,
    chunks_per_step,
    anchor_range,
    exact,
):
    q_ref, k_ref, v_ref, gate_ref = refs[:4]  # [n*C, K], [n*C, K], [n*C, Vt], [n*C, K] float32
    h0_ref = refs[4] if has_h0 else None  # [Vt, K]
    table_ref = refs[4 + has_h0]  # the key mask table
    outs = refs[5 + has_h0 :]
    o_ref = outs[0]  # [n*C, Vt]
    scores_ref = outs[1] if has_scores else None  # [n, C, C] ([C, C] for n = 1)
    ht_ref = outs[1 + has_scores] if has_ht else None  # [Vt, K]
    state_ref, start_ref = refs[-2:]  # VMEM scratch [Vt, K] float32: the carried state, the step's first
    n, c = chunks_per_step, chunk
    first_chunk = pl.program_id(3) * n
    carry_in(state_ref, first_chunk, first_ref[first_chunk] == 1, h0_ref)
    start = state_ref[...]
    start_ref[...] = start
    decays = StepDecays(gate_ref[...], table_ref, c, anchor_range)
    q, k = chunk_rows(q_ref, n, jnp.float32), chunk_rows(k_ref, n, jnp.float32)  # [n, C, K]
    v = chunk_rows(v_ref, n)  # [n, C, Vt]
    scores = dot(q * decays.row_factor, k * decays.column_factor, BATCHED_NT, dtype)  # [n, C, C]
    scores = jnp.where(causal_mask(n, c), scores, 0.0)
    if has_scores:
        store_per_chunk(scores_ref, scores)
    intra = dot(scores, v, BATCHED_NN, dtype)  # [n, C, Vt]
    updates = dot(v, k * decays.to_end, BATCHED_TN, dtype)  # [n, Vt, K]
    states, state = state_chain(start, decays.last_decay, updates)
    state_ref[...] = state
    inter = dot(q * decays.from_start, states, BATCHED_NT, dtype)  # [n, C, Vt]
    store_chunk_rows(o_ref, scale * (inter + intra))

    if has_ht:

        @pl.when(last_ref[first_chunk + n - 1] == 1)
        def _final():
            ht_ref[...] = state

    @pl.when(jnp.logical_not(decays.in_range & jnp.isfinite(jnp.sum(state))))
    def _exact():
        state_ref[...] = start_ref[...]
        exact(first_ref, last_ref, seq_ref, *refs[:-1])


def chunk_fwd(
    q,
    k,
    v,
    gate,
    h0,
    meta,
    *,
    specs: ChunkSpecs,
    scale: float,
    output_final_state: bool,
    interpret: bool,
    keep_scores: bool = False,
    anchor_range: float = 0.0,
):
    """Outputs of every chunk, the final states and (for the backward) the intra-chunk scores.

    Args:
      q, k: [B, H, Tp, K] (Tp = NT * C, K a multiple of 128); v: [B, H, Tp, V].
      gate: per-step log decays, float32: "scalar" mode [B, H, NT, 1, C] or "key" mode [B, H, Tp, K].
      h0: [N, H, V, K] float32 or None (N = B * specs.states_per_row).
      meta: `ChunkMeta` (first/last/sequence per chunk).
      specs: V-tiled block shapes and index maps of this call (several chunks per grid step only
        for fixed-length inputs: one per-sequence state per batch row).
      output_final_state: also return the final states.
      keep_scores: also return every chunk's intra-chunk scores, for `chunk_bwd_dv`.
      anchor_range: for a per-key gate, the largest |D| of the anchored products
        (`anchored.StepDecays`); 0 takes the exact level products everywhere.

    Returns:
      (o [B, H, Tp, V] in v's dtype, ht [N, H, V, K] float32 or None, scores
      [B, H, NF, NT, C, C] in the MXU dtype of q (one copy per V tile) or None). Under `jax.vmap`
      the mapped axis folds into B and N (`gla_core.pallas_transforms.fold_vmap`).
    """
    launch = functools.partial(
        _launch,
        specs=specs,
        scale=scale,
        output_final_state=output_final_state,
        keep_scores=keep_scores,
        anchor_range=anchor_range,
        interpret=interpret,
    )
    args = (q, k, v, gate, h0, meta.first, meta.last, meta.sequence)
    return fold_vmap(launch, args, in_axes=(0, 0, 0, 0, 0, None, None, None), out_axes=0)


def _launch(
    q, k, v, gate, h0, first, last, sequence, *, specs, scale, output_final_state, keep_scores, anchor_range, interpret
):
    dtype = mxu_dtype(q.dtype)
    flags = dict(has_h0=h0 is not None, has_ht=output_final_state, has_scores=keep_scores, scale=scale, dtype=dtype)
    kernel = functools.partial(_fwd_kernel, gate_mode=specs.gate_mode, chunks_per_step=specs.chunks_per_step, **flags)
    step_kernel = None
    if specs.gate_mode == "key" and anchor_range > 0:
        step_kernel = functools.partial(
            _anchored_step_kernel,
            chunk=specs.chunk,
            chunks_per_step=specs.chunks_per_step,
            anchor_range=anchor_range,
            **flags,
        )
    args = (q, k, v, gate, h0, first, last, sequence)
    return launch_output_pass(
        "chunk_fwd",
        kernel,
        *args,
        specs=specs,
        state_out=output_final_state,
        scores_dtype=dtype if keep_scores else None,
        step_kernel=step_kernel,
        interpret=interpret,
    )
