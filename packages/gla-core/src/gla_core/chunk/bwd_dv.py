"""`chunk_bwd_dv`: the value gradient of every chunk.

    dv_s = (k_s * e^{b_L - b_s}) G_c  +  scale * sum_{t>=s} A_ts do_t,
    A_ts = sum_k q_tk k_sk e^{b_tk - b_sk}

with `G_c` the gradient of the state after chunk c (`chunk_bwd_dh`) and `A` the intra-chunk
scores the forward kept (`chunk_fwd(keep_scores=True)`). Every grid axis is parallel. Per-key
gates take all chunks of a grid step at once (`_bwd_dv_step_kernel`, see `batched`).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from gla_core.chunk.anchored import StepDecays
from gla_core.chunk.batched import chunk_rows, gate_rows, load_per_chunk, store_chunk_rows
from gla_core.chunk.common import BATCHED_NT, BATCHED_TN, NT, TN, dot, mxu_dtype
from gla_core.chunk.gates import ScalarGate
from gla_core.chunk.launch import launch_value_pass
from gla_core.chunk.specs import ChunkSpecs
from gla_core.pallas_transforms import fold_vmap


def _bwd_dv_kernel(k_ref, do_ref, gate_ref, dh_ref, scores_ref, dv_ref, *, scale, dtype):
    # k [C, K]; do [C, Vt]; gate [1, C]; dh [Vt, K] float32; scores [C, C]; dv [C, Vt]
    gate = ScalarGate(gate_ref[...], dtype)
    k_decayed = k_ref[...].astype(jnp.float32) * gate.to_end()
    from_state = dot(k_decayed, dh_ref[...], NT, dtype)  # [C, Vt]
    intra = dot(scores_ref[...], do_ref[...], TN, dtype)
    dv_ref[...] = (from_state + scale * intra).astype(dv_ref.dtype)


def _bwd_dv_step_kernel(
    k_ref, do_ref, gate_ref, dh_ref, scores_ref, table_ref, dv_ref, *, scale, dtype, chunks_per_step
):
    # k [n*C, K]; do [n*C, Vt]; gate [n*C, K] or [n*C / 128, 128] float32; dh [n, Vt, K] float32; scores [n, C, C]
    # ([Vt, K] and [C, C] for n = 1); the key mask table; dv [n*C, Vt]
    n = chunks_per_step
    decays = StepDecays(gate_rows(gate_ref, *k_ref.shape), table_ref, k_ref.shape[0] // n)
    k_decayed = chunk_rows(k_ref, n, jnp.float32) * decays.to_end  # [n, C, K]
    from_state = dot(k_decayed, load_per_chunk(dh_ref, n), BATCHED_NT, dtype)  # [n, C, Vt]
    intra = dot(load_per_chunk(scores_ref, n), chunk_rows(do_ref, n), BATCHED_TN, dtype)  # [n, C, Vt]
    store_chunk_rows(dv_ref, from_state + scale * intra)


def chunk_bwd_dv(k, do, gate, dh, scores, *, specs: ChunkSpecs, scale: float, dtype, interpret: bool):
    """Value gradients.

    Args:
      k: [B, H, Tp, K]; do: [B, H, Tp, V]; gate: as in `chunk_fwd_h`;
      dh: [B, H, NT, V, K] float32 from `chunk_bwd_dh`;
      scores: [B, H, NF, NT, C, C] intra-chunk scores from `chunk_fwd(keep_scores=True)`
        (NF the V tiles of `specs`); dtype: dtype of dv.

    Returns:
      dv [B, H, Tp, V]. Under `jax.vmap` the mapped axis folds into B
      (`gla_core.pallas_transforms.fold_vmap`).
    """
    launch = functools.partial(_launch, specs=specs, scale=scale, dtype=dtype, interpret=interpret)
    return fold_vmap(launch, (k, do, gate, dh, scores), in_axes=(0,) * 5, out_axes=0)


def _launch(k, do, gate, dh, scores, *, specs: ChunkSpecs, scale: float, dtype, interpret: bool):
    per_step = specs.per_step
    if per_step:
        kernel = functools.partial(
            _bwd_dv_step_kernel, scale=scale, dtype=mxu_dtype(k.dtype), chunks_per_step=specs.chunks_per_step
        )
    else:
        kernel = functools.partial(_bwd_dv_kernel, scale=scale, dtype=mxu_dtype(k.dtype))
    return launch_value_pass(
        "chunk_bwd_dv",
        kernel,
        k,
        do,
        gate,
        dh,
        scores,
        specs=specs,
        out_dtype=dtype,
        interpret=interpret,
    )
