"""`chunk_fwd_h`: the state before every chunk, carried in VMEM along the sequential time axis.

Per chunk c (b_t the sum of the chunk's log decays through step t, L its last step):

    S_{c+1} = diag(e^{b_L}) S_c + sum_t (k_t * e^{b_L - b_t}) v_t^T

with the state reset to `initial_state[seq]` at the first chunk of every sequence and the
final state written at its last chunk (scalar-prefetched per-chunk metadata, see
`prepare.ChunkMeta`; packed sequences starting and ending inside a grid step: `packed`). States
are float32 and stored transposed, `[V, K]`. Per-key gates take
all chunks of a grid step at once (`_fwd_h_step_kernel`, see `batched`).
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


def _fwd_h_kernel(first_ref, last_ref, seq_ref, *refs, has_h0, has_ht, dtype, chunks_per_step, packed, chunk_in_step):
    k_ref, v_ref, gate_ref = refs[:3]  # [C, K], [C, Vt], [1, C]
    h0_ref = refs[3] if has_h0 else None  # [Vt, K] (packed: [N, H, V, K] in HBM)
    outs = refs[3 + has_h0 :]
    h_ref = outs[0]  # [Vt, K] state before this chunk
    ht_ref = outs[1] if has_ht else None  # [Vt, K] (packed: [N, H, V, K] in HBM)
    state_ref = outs[-1]  # VMEM scratch [Vt, K] float32
    sequences = packed.states(first_ref, last_ref, seq_ref, h0_ref, ht_ref) if packed is not None else None
    t = pl.program_id(3) * chunks_per_step + chunk_in_step  # the chunk
    opens_step, closes_step = step_edges(chunk_in_step, chunks_per_step)
    carry_in_chunk(state_ref, t, t, opens_step, first_ref, h0_ref, sequences)
    state = state_ref[...]
    h_ref[...] = state
    gate = ScalarGate(gate_ref[...], dtype)
    k_decayed = k_ref[...].astype(jnp.float32) * gate.to_end()  # [C, K]
    state = state * gate.last_decay() + dot(v_ref[...], k_decayed, TN, dtype)
    state_ref[...] = state
    carry_out_chunk(state_ref, state, t, closes_step, last_ref, ht_ref, sequences)


def _fwd_h_step_kernel(first_ref, last_ref, seq_ref, *refs, has_h0, has_ht, dtype, chunk, chunks_per_step, packed):
    k_ref, v_ref, gate_ref = refs[:3]  # [n*C, K], [n*C, Vt], [n*C, K] or [n*C / 128, 128] float32
    h0_ref = refs[3] if has_h0 else None  # [Vt, K] (packed: [N, H, V, K] in HBM)
    table_ref = refs[3 + has_h0]  # the key mask table
    outs = refs[4 + has_h0 :]
    h_ref = outs[0]  # [n, Vt, K] ([Vt, K] for n = 1): the state before every chunk
    ht_ref = outs[1] if has_ht else None  # [Vt, K] (packed: [N, H, V, K] in HBM)
    state_ref = outs[-1]  # VMEM scratch [Vt, K] float32
    n = chunks_per_step
    first_chunk = pl.program_id(3) * n
    carry_in_step(state_ref, first_chunk, first_ref[first_chunk] == 1, h0_ref, packed is not None)
    edges = None
    if packed is not None:
        edges = ChainEdges(packed.states(first_ref, last_ref, seq_ref, h0_ref, ht_ref), state_ref, first_chunk)
    decays = StepDecays(gate_rows(gate_ref, *k_ref.shape), table_ref, chunk)
    k = chunk_rows(k_ref, n, jnp.float32)  # [n, C, K]
    updates = dot(chunk_rows(v_ref, n), k * decays.to_end, BATCHED_TN, dtype)  # [n, Vt, K]
    states, state = state_chain(state_ref[...][None], decays.last_decay, updates, edges=edges)  # one group
    state = state[0]
    store_per_chunk(h_ref, states)
    state_ref[...] = state

    if has_ht and edges is None:

        @pl.when(last_ref[first_chunk + n - 1] == 1)
        def _final():
            ht_ref[...] = state


def chunk_fwd_h(k, v, gate, h0, meta, *, specs: ChunkSpecs, output_final_state: bool, interpret: bool):
    """States before every chunk.

    Args:
      k: [B, H, Tp, K] (Tp = NT * C, K a multiple of 128).
      v: [B, H, Tp, V].
      gate: per-step log decays, float32, by `specs.gate_mode`: "scalar" [B, H, NT, 1, C], "key"
        [B, H, Tp, K] or "broadcast" [B, H, NT / n, n*C / 128, 128].
      h0: [N, H, V, K] float32 or None (N = B * specs.states_per_row).
      meta: `ChunkMeta` (first/last/sequence per chunk).
      specs: block shapes and index maps of this call.
      output_final_state: also return the final states.

    Returns:
      (h [B, H, NT, V, K] float32, ht [N, H, V, K] float32 or None). Under `jax.vmap` the
      mapped axis folds into B and N (`gla_core.pallas_transforms.fold_vmap`).
    """
    launch = functools.partial(_launch, specs=specs, output_final_state=output_final_state, interpret=interpret)
    args = (k, v, gate, h0, meta.first, meta.last, meta.sequence)
    h, ht = fold_vmap(launch, args, in_axes=(0, 0, 0, 0, None, None, None), out_axes=0)
    return h, ht


def _launch(k, v, gate, h0, first, last, sequence, *, specs: ChunkSpecs, output_final_state: bool, interpret: bool):
    flags = dict(
        has_h0=h0 is not None, has_ht=output_final_state, dtype=mxu_dtype(k.dtype), packed=specs.packed_layout()
    )
    per_step = specs.per_step
    if per_step:
        kernel = functools.partial(
            _fwd_h_step_kernel, chunk=specs.chunk, chunks_per_step=specs.chunks_per_step, **flags
        )
    else:
        kernel = functools.partial(_fwd_h_kernel, chunks_per_step=specs.chunks_per_step, **flags)
    state_args = (k, v, gate, h0, first, last, sequence)
    return launch_state_pass(
        "chunk_fwd_h",
        kernel,
        *state_args,
        specs=specs,
        state_out=output_final_state,
        interpret=interpret,
    )
