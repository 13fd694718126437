"""`chunk_fwd_o`: the output of every chunk, inter-chunk `q . h` plus intra-chunk causal attention.

    o_t = scale * ( (q_t * e^{b_t}) S_c  +  sum_{s<=t} (sum_k q_tk k_sk e^{b_tk - b_sk}) v_s )

Chunks are independent given the states `S_c` from `chunk_fwd_h`, so every grid axis is
parallel. `scale` multiplies the float32 accumulations (q is never pre-scaled).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from gla_core.chunk.common import NT, causal_dot, dot, mxu_dtype
from gla_core.chunk.gates import make_gate
from gla_core.chunk.launch import launch_value_pass
from gla_core.chunk.specs import ChunkSpecs
from gla_core.pallas_transforms import fold_vmap


def _fwd_o_kernel(q_ref, k_ref, v_ref, gate_ref, h_ref, *refs, gate_mode, scale, dtype):
    # q, k [C, K]; v [C, Vt]; gate [1, C] or [C, K]; h [Vt, K] float32; [key mask table]; o [C, Vt]
    o_ref = refs[-1]
    gate = make_gate(gate_mode, gate_ref[...], dtype, *refs[:-1])
    q = q_ref[...]
    q_decayed = q.astype(jnp.float32) * gate.from_start()
    inter = dot(q_decayed, h_ref[...], NT, dtype)  # [C, Vt]
    scores = gate.scores(q, k_ref[...])  # [C, C]
    intra = causal_dot(scores, v_ref[...], dtype)  # a non-finite v_s reaches rows t >= s only
    o_ref[...] = (scale * (inter + intra)).astype(o_ref.dtype)


def chunk_fwd_o(q, k, v, gate, h, *, specs: ChunkSpecs, scale: float, interpret: bool):
    """Outputs of every chunk.

    Args:
      q, k: [B, H, Tp, K]; v: [B, H, Tp, V]; gate: as in `chunk_fwd_h`;
      h: [B, H, NT, V, K] float32 states before every chunk.

    Returns:
      o [B, H, Tp, V] in v's dtype. Under `jax.vmap` the mapped axis folds into B
      (`gla_core.pallas_transforms.fold_vmap`).
    """
    launch = functools.partial(_launch, specs=specs, scale=scale, interpret=interpret)
    return fold_vmap(launch, (q, k, v, gate, h), in_axes=(0,) * 5, out_axes=0)


def _launch(q, k, v, gate, h, *, specs: ChunkSpecs, scale: float, interpret: bool):
    kernel = functools.partial(_fwd_o_kernel, gate_mode=specs.gate_mode, scale=scale, dtype=mxu_dtype(q.dtype))
    return launch_value_pass(
        "chunk_fwd_o", kernel, q, k, v, gate, h, specs=specs, out_dtype=v.dtype, interpret=interpret
    )
