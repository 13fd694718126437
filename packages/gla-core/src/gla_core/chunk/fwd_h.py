"""`chunk_fwd_h`: the state before every chunk, carried in VMEM along the sequential time axis.

Per chunk c (b_t the sum of the chunk's log decays through step t, L its last step):

    S_{c+1} = diag(e^{b_L}) S_c + sum_t (k_t * e^{b_L - b_t}) v_t^T

with the state reset to `initial_state[seq]` at the first chunk of every sequence and the
final state written at its last chunk (scalar-prefetched per-chunk metadata, see
`prepare.ChunkMeta`). States are float32 and stored transposed, `[V, K]`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_core.chunk.common import TN, compiler_params, cost_estimate, dot, mxu_dtype
from gla_core.chunk.gates import intra_costs, make_gate
from gla_core.chunk.specs import ChunkSpecs
from gla_core.pallas_transforms import fold_vmap
from gla_core.tpu import interpret_params


def _fwd_h_kernel(first_ref, last_ref, seq_ref, *refs, gate_mode, has_h0, has_ht, dtype):
    k_ref, v_ref, gate_ref = refs[:3]  # [C, K], [C, Vt], [1, C] or [C, K]
    h0_ref = refs[3] if has_h0 else None  # [Vt, K]
    outs = refs[3 + has_h0 :]
    h_ref = outs[0]  # [Vt, K] state before this chunk
    ht_ref = outs[1] if has_ht else None  # [Vt, K]
    state_ref = outs[-1]  # VMEM scratch [Vt, K] float32
    t = pl.program_id(3)

    @pl.when(t == 0)
    def _start():
        state_ref[...] = jnp.zeros(state_ref.shape, jnp.float32)

    @pl.when(first_ref[t] == 1)
    def _reset():
        if has_h0:
            state_ref[...] = h0_ref[...].astype(jnp.float32)
        else:
            state_ref[...] = jnp.zeros(state_ref.shape, jnp.float32)

    state = state_ref[...]
    h_ref[...] = state
    gate = make_gate(gate_mode, gate_ref[...], dtype)
    k_decayed = k_ref[...].astype(jnp.float32) * gate.to_end()  # [C, K]
    state = state * gate.last_decay() + dot(v_ref[...], k_decayed, TN, dtype)
    state_ref[...] = state

    if has_ht:

        @pl.when(last_ref[t] == 1)
        def _final():
            ht_ref[...] = state


def chunk_fwd_h(k, v, gate, h0, meta, *, specs: ChunkSpecs, output_final_state: bool, interpret: bool):
    """States before every chunk.

    Args:
      k: [B, H, Tp, K] (Tp = NT * C, K a multiple of 128).
      v: [B, H, Tp, V].
      gate: per-step log decays, float32: "scalar" mode [B, H, NT, 1, C] or "key" mode [B, H, Tp, K].
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
    b, h, tp, kdim = k.shape
    vdim = v.shape[-1]
    nt, nv = specs.num_chunks, specs.num_tiles
    has_h0 = h0 is not None
    in_specs = [specs.key(), specs.value(), specs.gate()]
    inputs = [k, v, gate]
    if has_h0:
        in_specs.append(specs.state_of_sequence())
        inputs.append(h0)
    out_shape = [jax.ShapeDtypeStruct((b, h, nt, vdim, kdim), jnp.float32)]
    out_specs = [specs.chunk_state()]
    if output_final_state:
        out_shape.append(jax.ShapeDtypeStruct((b * specs.states_per_row, h, vdim, kdim), jnp.float32))
        out_specs.append(specs.state_of_sequence())
    kernel = functools.partial(
        _fwd_h_kernel,
        gate_mode=specs.gate_mode,
        has_h0=has_h0,
        has_ht=output_final_state,
        dtype=mxu_dtype(k.dtype),
    )
    gate_flops, gate_transcendentals = intra_costs(specs.gate_mode, specs.chunk, kdim, products=0)
    flops = b * h * nv * nt * gate_flops + 2 * b * h * tp * kdim * vdim + 3 * b * h * nt * kdim * vdim
    cost = cost_estimate(flops, b * h * nv * nt * gate_transcendentals, [k, v, gate, h0, *out_shape])
    with jax.named_scope("chunk_fwd_h"):
        outs = pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=3,
                grid=specs.grid(b, h),
                in_specs=in_specs,
                out_specs=out_specs,
                scratch_shapes=[pltpu.VMEM((specs.block_v, kdim), jnp.float32)],
            ),
            compiler_params=compiler_params("parallel", "parallel", "parallel", "arbitrary"),
            interpret=interpret_params(interpret),
            cost_estimate=cost,
            name="chunk_fwd_h",
        )(first, last, sequence, *inputs)
    return outs[0], (outs[1] if output_final_state else None)
