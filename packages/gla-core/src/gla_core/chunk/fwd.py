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

Per-key gates take a grid step at a time (`_step_kernel`, the math of `step_math`): every chunk
of the step together, with the anchored products and the state chain reduced to elementwise
updates. A step whose decays are out of the anchor range is recomputed with the blocked products,
or the exact level products where even a sub-block is out of range (`products.recompute_products`;
the level products every step when the anchor range is 0); one holding a non-finite value (which
the unmasked products would carry into earlier rows) has its outputs formed again from the same
products with the values masked. The chunk-by-chunk
`_fwd_kernel` serves scalar gates.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_core.chunk.anchored import StepDecays
from gla_core.chunk.batched import chunk_rows, gate_rows, store_chunk_rows, store_per_chunk
from gla_core.chunk.common import NT, TN, causal_dot, dot, mxu_dtype
from gla_core.chunk.gates import ScalarGate
from gla_core.chunk.launch import carry_in_chunk, carry_in_step, carry_out_chunk, launch_output_pass, step_edges
from gla_core.chunk.packed import ChainEdges
from gla_core.chunk.specs import ChunkSpecs
from gla_core.chunk.step_math import ForwardStep, run_forward
from gla_core.pallas_transforms import fold_vmap


def _fwd_kernel(
    first_ref,
    last_ref,
    seq_ref,
    *refs,
    has_h0,
    has_ht,
    has_scores,
    has_states,
    scale,
    dtype,
    chunks_per_step,
    packed,
    chunk_in_step,
):
    q_ref, k_ref, v_ref, gate_ref = refs[:4]  # [C, K], [C, K], [C, Vt], [1, C]
    h0_ref = refs[4] if has_h0 else None  # [Vt, K] (packed: [N, H, V, K] in HBM)
    outs = refs[4 + has_h0 :]
    o_ref = outs[0]  # [C, Vt]
    scores_ref = outs[1] if has_scores else None  # [C, C]
    states_ref = outs[1 + has_scores] if has_states else None  # [Vt, K] the state before the chunk
    ht_ref = outs[1 + has_scores + has_states] if has_ht else None  # [Vt, K] (packed: [N, H, V, K] in HBM)
    state_ref = refs[-1]  # VMEM scratch [Vt, K] float32
    sequences = packed.states(first_ref, last_ref, seq_ref, h0_ref, ht_ref) if packed is not None else None
    t = pl.program_id(3) * chunks_per_step + chunk_in_step  # the chunk
    opens_step, closes_step = step_edges(chunk_in_step, chunks_per_step)
    carry_in_chunk(state_ref, t, t, opens_step, first_ref, h0_ref, sequences)
    state = state_ref[...]
    if has_states:
        states_ref[...] = state
    gate = ScalarGate(gate_ref[...], dtype)
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
    carry_out_chunk(state_ref, state, t, closes_step, last_ref, ht_ref, sequences)


def _step_kernel(
    first_ref,
    last_ref,
    seq_ref,
    *refs,
    has_h0,
    has_ht,
    has_scores,
    has_states,
    scale,
    dtype,
    chunk,
    chunks_per_step,
    anchor_range,
    packed,
):
    q_ref, k_ref, v_ref, gate_ref = refs[:4]  # [n*C, K], [n*C, K], [n*C, Vt], [n*C, K] or [n*C / 128, 128] float32
    h0_ref = refs[4] if has_h0 else None  # [Vt, K] (packed: [N, H, V, K] in HBM)
    table_ref = refs[4 + has_h0]  # the key mask table
    outs = refs[5 + has_h0 :]
    o_ref = outs[0]  # [n*C, Vt]
    scores_ref = outs[1] if has_scores else None  # [n, C, C] ([C, C] for n = 1)
    states_ref = outs[1 + has_scores] if has_states else None  # [n, Vt, K] ([Vt, K] for n = 1)
    ht_ref = outs[1 + has_scores + has_states] if has_ht else None  # [Vt, K] (packed: [N, H, V, K] in HBM)
    state_ref = refs[-1]  # VMEM scratch [Vt, K] float32: the carried state
    n = chunks_per_step
    first_chunk = pl.program_id(3) * n
    carry_in_step(state_ref, first_chunk, first_ref[first_chunk] == 1, h0_ref, packed is not None)
    start = state_ref[...][None]  # [1, Vt, K]: one group of n chunks
    edges = None
    if packed is not None:
        edges = ChainEdges(packed.states(first_ref, last_ref, seq_ref, h0_ref, ht_ref), state_ref, first_chunk)
    a = gate_rows(gate_ref, *q_ref.shape)  # [n*C, K]
    q, k = chunk_rows(q_ref, n, jnp.float32), chunk_rows(k_ref, n, jnp.float32)  # [n, C, K]
    v = chunk_rows(v_ref, n)  # [n, C, Vt]
    decays = StepDecays(a, table_ref, chunk, anchor_range if anchor_range > 0 else None)

    def write(step: ForwardStep, o):
        store_chunk_rows(o_ref, o)
        if has_scores:
            store_per_chunk(scores_ref, step.scores)
        if has_states:
            store_per_chunk(states_ref, step.states)
        state_ref[...] = step.end[0]

        if has_ht and edges is None:

            @pl.when(last_ref[first_chunk + n - 1] == 1)
            def _final():
                ht_ref[...] = step.end[0]

    run_forward(decays, a, table_ref, q, k, v, start, write, scale=scale, dtype=dtype, chunk=chunk, edges=edges)


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
    keep_states: bool = False,
    anchor_range: float = 0.0,
):
    """Outputs of every chunk, the final states and (for the backward) the intra-chunk scores and
    the states before every chunk.

    Args:
      q, k: [B, H, Tp, K] (Tp = NT * C, K a multiple of 128); v: [B, H, Tp, V].
      gate: per-step log decays, float32, by `specs.gate_mode`: "scalar" [B, H, NT, 1, C], "key"
        [B, H, Tp, K] or "broadcast" [B, H, NT / n, n*C / 128, 128].
      h0: [N, H, V, K] float32 or None (N = B * specs.states_per_row).
      meta: `ChunkMeta` (first/last/sequence per chunk).
      specs: V-tiled block shapes and index maps of this call (packed sequences with several chunks
        per grid step keep h0 and ht in HBM, see `packed`).
      output_final_state: also return the final states.
      keep_scores: also return every chunk's intra-chunk scores, for `chunk_bwd_dv`.
      keep_states: also return the state before every chunk, for `bwd.chunk_bwd`.
      anchor_range: for a per-key gate, the largest |D| of the anchored products
        (`anchored.StepDecays`); 0 takes the exact level products everywhere.

    Returns:
      (o [B, H, Tp, V] in v's dtype, ht [N, H, V, K] float32 or None, scores
      [B, H, NF, NT, C, C] in the MXU dtype of q (one copy per V tile) or None, states
      [B, H, NT, V, K] float32 or None). Under `jax.vmap` the mapped axis folds into B and N
      (`gla_core.pallas_transforms.fold_vmap`).
    """
    launch = functools.partial(
        _launch,
        specs=specs,
        scale=scale,
        output_final_state=output_final_state,
        keep_scores=keep_scores,
        keep_states=keep_states,
        anchor_range=anchor_range,
        interpret=interpret,
    )
    args = (q, k, v, gate, h0, meta.first, meta.last, meta.sequence)
    return fold_vmap(launch, args, in_axes=(0, 0, 0, 0, 0, None, None, None), out_axes=0)


def _launch(
    q,
    k,
    v,
    gate,
    h0,
    first,
    last,
    sequence,
    *,
    specs,
    scale,
    output_final_state,
    keep_scores,
    keep_states,
    anchor_range,
    interpret,
):
    dtype = mxu_dtype(q.dtype)
    flags = dict(
        has_h0=h0 is not None,
        has_ht=output_final_state,
        has_scores=keep_scores,
        has_states=keep_states,
        scale=scale,
        dtype=dtype,
        packed=specs.packed_layout(),
    )
    per_step = specs.per_step
    if per_step:
        kernel = functools.partial(
            _step_kernel,
            chunk=specs.chunk,
            chunks_per_step=specs.chunks_per_step,
            anchor_range=anchor_range,
            **flags,
        )
    else:
        kernel = functools.partial(_fwd_kernel, chunks_per_step=specs.chunks_per_step, **flags)
    args = (q, k, v, gate, h0, first, last, sequence)
    return launch_output_pass(
        "chunk_fwd",
        kernel,
        *args,
        specs=specs,
        state_out=output_final_state,
        scores_dtype=dtype if keep_scores else None,
        keep_states=keep_states,
        anchored=per_step and anchor_range > 0,
        interpret=interpret,
    )
