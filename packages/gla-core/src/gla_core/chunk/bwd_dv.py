"""`chunk_bwd_dv`: the value gradient of every chunk.

    dv_s = (k_s * e^{b_L - b_s}) G_c  +  scale * sum_{t>=s} A_ts do_t,
    A_ts = sum_k q_tk k_sk e^{b_tk - b_sk}

with `G_c` the gradient of the state after chunk c (`chunk_bwd_dh`). Every grid axis is
parallel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_core.chunk.common import NT, TN, compiler_params, cost_estimate, dot, mxu_dtype
from gla_core.chunk.gates import intra_costs, make_gate
from gla_core.chunk.specs import ChunkSpecs
from gla_core.pallas_transforms import fold_vmap
from gla_core.tpu import interpret_params


def _bwd_dv_kernel(q_ref, k_ref, do_ref, gate_ref, dh_ref, dv_ref, *, gate_mode, scale, dtype):
    # q, k [C, K]; do [C, Vt]; gate [1, C] or [C, K]; dh [Vt, K] float32; dv [C, Vt]
    gate = make_gate(gate_mode, gate_ref[...], dtype)
    k = k_ref[...]
    k_decayed = k.astype(jnp.float32) * gate.to_end()
    from_state = dot(k_decayed, dh_ref[...], NT, dtype)  # [C, Vt]
    scores = gate.scores(q_ref[...], k)  # [C, C]
    intra = dot(scores, do_ref[...], TN, dtype)
    dv_ref[...] = (from_state + scale * intra).astype(dv_ref.dtype)


def chunk_bwd_dv(q, k, do, gate, dh, *, specs: ChunkSpecs, scale: float, dtype, interpret: bool):
    """Value gradients.

    Args:
      q, k: [B, H, Tp, K]; do: [B, H, Tp, V]; gate: as in `chunk_fwd_h`;
      dh: [B, H, NT, V, K] float32 from `chunk_bwd_dh`; dtype: dtype of dv.

    Returns:
      dv [B, H, Tp, V]. Under `jax.vmap` the mapped axis folds into B
      (`gla_core.pallas_transforms.fold_vmap`).
    """
    launch = functools.partial(_launch, specs=specs, scale=scale, dtype=dtype, interpret=interpret)
    return fold_vmap(launch, (q, k, do, gate, dh), in_axes=(0,) * 5, out_axes=0)


def _launch(q, k, do, gate, dh, *, specs: ChunkSpecs, scale: float, dtype, interpret: bool):
    b, hh, tp, kdim = q.shape
    vdim = do.shape[-1]
    nv, nt, c = specs.num_tiles, specs.num_chunks, specs.chunk
    out_shape = jax.ShapeDtypeStruct((b, hh, tp, vdim), dtype)
    kernel = functools.partial(_bwd_dv_kernel, gate_mode=specs.gate_mode, scale=scale, dtype=mxu_dtype(q.dtype))
    flops, transcendentals = intra_costs(specs.gate_mode, c, kdim, products=1)
    flops = b * hh * nv * nt * (flops + 2 * c * kdim * specs.block_v + 2 * c * c * specs.block_v)
    transcendentals = b * hh * nv * nt * transcendentals
    with jax.named_scope("chunk_bwd_dv"):
        return pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=specs.grid(b, hh),
            in_specs=[specs.key(), specs.key(), specs.value(), specs.gate(), specs.chunk_state()],
            out_specs=specs.value(),
            compiler_params=compiler_params("parallel", "parallel", "parallel", "parallel"),
            interpret=interpret_params(interpret),
            cost_estimate=cost_estimate(flops, transcendentals, [q, k, do, gate, dh, out_shape]),
            name="chunk_bwd_dv",
        )(q, k, do, gate, dh)
