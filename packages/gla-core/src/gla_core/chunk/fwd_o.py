"""`chunk_fwd_o`: the output of every chunk, inter-chunk `q . h` plus intra-chunk causal attention.

    o_t = scale * ( (q_t * e^{b_t}) S_c  +  sum_{s<=t} (sum_k q_tk k_sk e^{b_tk - b_sk}) v_s )

Chunks are independent given the states `S_c` from `chunk_fwd_h`, so every grid axis is
parallel. `scale` multiplies the float32 accumulations (q is never pre-scaled).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_core.chunk.common import NT, causal_dot, compiler_params, cost_estimate, dot, mxu_dtype
from gla_core.chunk.gates import intra_costs, make_gate
from gla_core.chunk.specs import ChunkSpecs
from gla_core.pallas_transforms import fold_vmap
from gla_core.tpu import interpret_params


def _fwd_o_kernel(q_ref, k_ref, v_ref, gate_ref, h_ref, o_ref, *, gate_mode, scale, dtype):
    # q, k [C, K]; v [C, Vt]; gate [1, C] or [C, K]; h [Vt, K] float32; o [C, Vt]
    gate = make_gate(gate_mode, gate_ref[...], dtype)
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
    b, hh, tp, kdim = q.shape
    vdim = v.shape[-1]
    nv, nt, c = specs.num_tiles, specs.num_chunks, specs.chunk
    out_shape = jax.ShapeDtypeStruct((b, hh, tp, vdim), v.dtype)
    kernel = functools.partial(_fwd_o_kernel, gate_mode=specs.gate_mode, scale=scale, dtype=mxu_dtype(q.dtype))
    flops, transcendentals = intra_costs(specs.gate_mode, c, kdim, products=1)
    flops = b * hh * nv * nt * (flops + 2 * c * kdim * specs.block_v + 2 * c * c * specs.block_v)
    transcendentals = b * hh * nv * nt * transcendentals
    with jax.named_scope("chunk_fwd_o"):
        return pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=specs.grid(b, hh),
            in_specs=[specs.key(), specs.key(), specs.value(), specs.gate(), specs.chunk_state()],
            out_specs=specs.value(),
            compiler_params=compiler_params("parallel", "parallel", "parallel", "parallel"),
            interpret=interpret_params(interpret),
            cost_estimate=cost_estimate(flops, transcendentals, [q, k, v, gate, h, out_shape]),
            name="chunk_fwd_o",
        )(q, k, v, gate, h)
