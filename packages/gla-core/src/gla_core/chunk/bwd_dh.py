"""`chunk_bwd_dh`: the state gradient of every chunk, carried in VMEM backwards in time.

With `G_c = d loss / d S_{c+1}` (the gradient of the state a chunk produces):

    G_{c-1} = diag(e^{b_L}) G_c + scale * sum_t (q_t * e^{b_t}) do_t^T

`G` is reset to the final-state gradient `dht[seq]` (or zero) at the last chunk of every
sequence, and the gradient of the initial state `dh0[seq]` is written after its first
chunk (packed sequences starting and ending inside a grid step: `packed`). The time grid axis runs
backwards through the index maps (no flipped copies).
Gradients are float32 and stored transposed, `[V, K]`. Per-key gates take all chunks of a grid
step at once (`_bwd_dh_step_kernel`, see `batched`).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_core.chunk.anchored import StepDecays
from gla_core.chunk.batched import chunk_rows, gate_rows, state_chain, store_per_chunk
from gla_core.chunk.common import BATCHED_TN, TN, dot, mxu_dtype
from gla_core.chunk.gates import ScalarGate
from gla_core.chunk.launch import carry_in_chunk, carry_in_step, carry_out_chunk, launch_state_pass, step_edges
from gla_core.chunk.packed import ChainEdges
from gla_core.chunk.specs import ChunkSpecs
from gla_core.pallas_transforms import fold_vmap


def _bwd_dh_kernel(
    first_ref,
    last_ref,
    seq_ref,
    *refs,
    has_dht,
    has_dh0,
    scale,
    num_chunks,
    dtype,
    chunks_per_step,
    packed,
    chunk_in_step,
):
    q_ref, do_ref, gate_ref = refs[:3]  # [C, K], [C, Vt], [1, C]
    dht_ref = refs[3] if has_dht else None  # [Vt, K] (packed: [N, H, V, K] in HBM)
    outs = refs[3 + has_dht :]
    dh_ref = outs[0]  # [Vt, K] gradient of the state after this chunk
    dh0_ref = outs[1] if has_dh0 else None  # [Vt, K] (packed: [N, H, V, K] in HBM)
    grad_ref = outs[-1]  # VMEM scratch [Vt, K] float32
    # walking backwards, a sequence starts at its last chunk and ends at its first
    sequences = packed.states(last_ref, first_ref, seq_ref, dht_ref, dh0_ref) if packed is not None else None
    walked = pl.program_id(3) * chunks_per_step + (chunks_per_step - 1 - chunk_in_step)  # chunks before this one
    c = num_chunks - 1 - walked  # the chunk
    opens_step, closes_step = step_edges(chunk_in_step, chunks_per_step, reverse=True)
    carry_in_chunk(grad_ref, walked, c, opens_step, last_ref, dht_ref, sequences)
    grad = grad_ref[...]
    dh_ref[...] = grad
    gate = ScalarGate(gate_ref[...], dtype)
    q_decayed = q_ref[...].astype(jnp.float32) * gate.from_start()  # [C, K]
    grad = grad * gate.last_decay() + scale * dot(do_ref[...], q_decayed, TN, dtype)
    grad_ref[...] = grad
    carry_out_chunk(grad_ref, grad, c, closes_step, first_ref, dh0_ref, sequences)


def _bwd_dh_step_kernel(
    first_ref, last_ref, seq_ref, *refs, has_dht, has_dh0, scale, num_chunks, dtype, chunk, chunks_per_step, packed
):
    q_ref, do_ref, gate_ref = refs[:3]  # [n*C, K], [n*C, Vt], [n*C, K] or [n*C / 128, 128] float32
    dht_ref = refs[3] if has_dht else None  # [Vt, K] (packed: [N, H, V, K] in HBM)
    table_ref = refs[3 + has_dht]  # the key mask table
    outs = refs[4 + has_dht :]
    dh_ref = outs[0]  # [n, Vt, K] ([Vt, K] for n = 1): the gradient of the state after every chunk
    dh0_ref = outs[1] if has_dh0 else None  # [Vt, K] (packed: [N, H, V, K] in HBM)
    grad_ref = outs[-1]  # VMEM scratch [Vt, K] float32
    n = chunks_per_step
    walked = pl.program_id(3) * n  # chunks after this step's
    last_chunk = num_chunks - 1 - walked
    carry_in_step(grad_ref, walked, last_ref[last_chunk] == 1, dht_ref, packed is not None)
    edges = None
    if packed is not None:  # walking backwards, a sequence starts at its last chunk and ends at its first
        states = packed.states(last_ref, first_ref, seq_ref, dht_ref, dh0_ref)
        edges = ChainEdges(states, grad_ref, last_chunk - n + 1)
    decays = StepDecays(gate_rows(gate_ref, *q_ref.shape), table_ref, chunk)
    q = chunk_rows(q_ref, n, jnp.float32)  # [n, C, K]
    updates = scale * dot(chunk_rows(do_ref, n), q * decays.from_start, BATCHED_TN, dtype)  # [n, Vt, K]
    grads, grad = state_chain(grad_ref[...][None], decays.last_decay, updates, reverse=True, edges=edges)
    grad = grad[0]
    store_per_chunk(dh_ref, grads)
    grad_ref[...] = grad

    if has_dh0 and edges is None:

        @pl.when(first_ref[last_chunk - n + 1] == 1)
        def _initial():
            dh0_ref[...] = grad


def chunk_bwd_dh(q, do, gate, dht, meta, *, specs: ChunkSpecs, scale: float, need_dh0: bool, interpret: bool):
    """Gradients of the state after every chunk, and of the initial states.

    Args:
      q: [B, H, Tp, K]; do: [B, H, Tp, V]; gate: as in `chunk_fwd_h`;
      dht: [N, H, V, K] float32 gradient of the final states, or None (zero).
      meta: `ChunkMeta`; specs: V-tiled ChunkSpecs walking time backwards (`reversed()`).
      need_dh0: also return the initial-state gradients.

    Returns:
      (dh [B, H, NT, V, K] float32, dh0 [N, H, V, K] float32 or None). Under `jax.vmap` the
      mapped axis folds into B and N (`gla_core.pallas_transforms.fold_vmap`).
    """
    if not specs.reverse:
        raise ValueError("chunk_bwd_dh needs reverse-time specs")
    launch = functools.partial(_launch, specs=specs, scale=scale, need_dh0=need_dh0, interpret=interpret)
    args = (q, do, gate, dht, meta.first, meta.last, meta.sequence)
    dh, dh0 = fold_vmap(launch, args, in_axes=(0, 0, 0, 0, None, None, None), out_axes=0)
    return dh, dh0


def _launch(q, do, gate, dht, first, last, sequence, *, specs: ChunkSpecs, scale: float, need_dh0: bool, interpret):
    flags = dict(
        has_dht=dht is not None,
        has_dh0=need_dh0,
        scale=scale,
        num_chunks=specs.num_chunks,
        dtype=mxu_dtype(q.dtype),
        chunks_per_step=specs.chunks_per_step,
        packed=specs.packed_layout(),
    )
    per_step = specs.per_step
    if per_step:
        kernel = functools.partial(_bwd_dh_step_kernel, chunk=specs.chunk, **flags)
    else:
        kernel = functools.partial(_bwd_dh_kernel, **flags)
    state_args = (q, do, gate, dht, first, last, sequence)
    return launch_state_pass("chunk_bwd_dh", kernel, *state_args, specs=specs, state_out=need_dh0, interpret=interpret)
