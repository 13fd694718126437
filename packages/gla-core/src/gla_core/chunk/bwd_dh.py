"""`chunk_bwd_dh`: the state gradient of every chunk, carried in VMEM backwards in time.

With `G_c = d loss / d S_{c+1}` (the gradient of the state a chunk produces):

    G_{c-1} = diag(e^{b_L}) G_c + scale * sum_t (q_t * e^{b_t}) do_t^T

`G` is reset to the final-state gradient `dht[seq]` (or zero) at the last chunk of every
sequence, and the gradient of the initial state `dh0[seq]` is written after its first
chunk. The time grid axis runs backwards through the index maps (no flipped copies).
Gradients are float32 and stored transposed, `[V, K]`.
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


def _bwd_dh_kernel(first_ref, last_ref, seq_ref, *refs, gate_mode, has_dht, has_dh0, scale, num_chunks, dtype):
    q_ref, do_ref, gate_ref = refs[:3]  # [C, K], [C, Vt], [1, C] or [C, K]
    dht_ref = refs[3] if has_dht else None  # [Vt, K]
    outs = refs[3 + has_dht :]
    dh_ref = outs[0]  # [Vt, K] gradient of the state after this chunk
    dh0_ref = outs[1] if has_dh0 else None  # [Vt, K]
    grad_ref = outs[-1]  # VMEM scratch [Vt, K] float32
    step = pl.program_id(3)
    c = num_chunks - 1 - step

    @pl.when(step == 0)
    def _start():
        grad_ref[...] = jnp.zeros(grad_ref.shape, jnp.float32)

    @pl.when(last_ref[c] == 1)
    def _reset():
        if has_dht:
            grad_ref[...] = dht_ref[...].astype(jnp.float32)
        else:
            grad_ref[...] = jnp.zeros(grad_ref.shape, jnp.float32)

    grad = grad_ref[...]
    dh_ref[...] = grad
    gate = make_gate(gate_mode, gate_ref[...], dtype)
    q_decayed = q_ref[...].astype(jnp.float32) * gate.from_start()  # [C, K]
    grad = grad * gate.last_decay() + scale * dot(do_ref[...], q_decayed, TN, dtype)
    grad_ref[...] = grad

    if has_dh0:

        @pl.when(first_ref[c] == 1)
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
    b, h, tp, kdim = q.shape
    vdim = do.shape[-1]
    nt, nv = specs.num_chunks, specs.num_tiles
    has_dht = dht is not None
    in_specs = [specs.key(), specs.value(), specs.gate()]
    inputs = [q, do, gate]
    if has_dht:
        in_specs.append(specs.state_of_sequence())
        inputs.append(dht)
    out_shape = [jax.ShapeDtypeStruct((b, h, nt, vdim, kdim), jnp.float32)]
    out_specs = [specs.chunk_state()]
    if need_dh0:
        out_shape.append(jax.ShapeDtypeStruct((b * specs.states_per_row, h, vdim, kdim), jnp.float32))
        out_specs.append(specs.state_of_sequence())
    kernel = functools.partial(
        _bwd_dh_kernel,
        gate_mode=specs.gate_mode,
        has_dht=has_dht,
        has_dh0=need_dh0,
        scale=scale,
        num_chunks=nt,
        dtype=mxu_dtype(q.dtype),
    )
    gate_flops, gate_transcendentals = intra_costs(specs.gate_mode, specs.chunk, kdim, products=0)
    flops = b * h * nv * nt * gate_flops + 2 * b * h * tp * kdim * vdim + 3 * b * h * nt * kdim * vdim
    cost = cost_estimate(flops, b * h * nv * nt * gate_transcendentals, [q, do, gate, dht, *out_shape])
    with jax.named_scope("chunk_bwd_dh"):
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
            name="chunk_bwd_dh",
        )(first, last, sequence, *inputs)
    return outs[0], (outs[1] if need_dh0 else None)
