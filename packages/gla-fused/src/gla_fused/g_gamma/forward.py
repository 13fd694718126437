"""`fused_g_gamma_forward`: outputs and final states of simple_gla with only a constant decay, one kernel.

Per chunk c (decays from `decay.ChunkDecay`, state `S_c` before the chunk, `[K, V]`):

    o_t     = scale * ( e^{b_t} q_t S_c + sum_{s<=t} e^{gamma (p_t - p_s)} (q_t . k_s) v_s )
    S_{c+1} = e^{gamma n} S_c + sum_s e^{gamma (n - p_s)} k_s v_s^T

The state lives in a float32 VMEM scratch along the sequential time axis (stored transposed,
`[Vt, Kp]`); the intra-chunk attention is formed in VMEM and never stored. Grid
`(B, H, NV, NT)`: V is tiled, every block holds all of K.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_core.kit import NT, TN, causal_dot, compiler_params, cost_estimate, dot, fold_vmap, interpret_params, mxu_dtype
from gla_fused.g_gamma.decay import ChunkDecay, valid_steps
from gla_fused.g_gamma.specs import GammaSpecs

NAME = "fused_g_gamma_fwd"


def _forward_kernel(gamma_ref, q_ref, k_ref, v_ref, *refs, has_h0, has_ht, scale, seq_len, num_chunks, dtype):
    # gamma [H] (SMEM); q, k [C, Kp]; v [C, Vt]; h0 [Vt, Kp] float32
    h0_ref = refs[0] if has_h0 else None
    outs = refs[has_h0:]
    o_ref = outs[0]  # [C, Vt]
    ht_ref = outs[1] if has_ht else None  # [Vt, Kp] float32
    state_ref = outs[-1]  # VMEM scratch [Vt, Kp] float32: the state before this chunk
    chunk_index = pl.program_id(3)
    chunk = q_ref.shape[0]

    @pl.when(chunk_index == 0)
    def _start():
        if has_h0:
            state_ref[...] = h0_ref[...]
        else:
            state_ref[...] = jnp.zeros(state_ref.shape, jnp.float32)

    decay = ChunkDecay(gamma_ref[pl.program_id(1)], valid_steps(chunk_index, chunk, seq_len), chunk)
    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    state = state_ref[...]
    inter = dot(q.astype(jnp.float32) * decay.from_start, state, NT, dtype)  # [C, Vt]
    scores = decay.decayed(dot(q, k, NT, dtype))  # [C, C]
    intra = causal_dot(scores, v, dtype, decay.causal)  # a non-finite v_s reaches rows t >= s only
    o_ref[...] = (scale * (inter + intra)).astype(o_ref.dtype)
    state = state * decay.last + dot(v, k.astype(jnp.float32) * decay.to_end, TN, dtype)
    state_ref[...] = state

    if has_ht:

        @pl.when(chunk_index == num_chunks - 1)
        def _final():
            ht_ref[...] = state


def fused_g_gamma_forward(
    q, k, v, gamma, h0, *, specs: GammaSpecs, seq_len: int, scale: float, output_final_state: bool, interpret: bool
):
    """Outputs and final states.

    Args:
      q, k: [B, H, Tp, Kp] (Tp = NT * C, Kp a multiple of 128); v: [B, H, Tp, Vp].
      gamma: [H] float32 log decay per step and head.
      h0: [B, H, Vp, Kp] float32 initial states (transposed), or None for zeros.
      specs: forward `GammaSpecs`; seq_len: T, the unpadded length (later steps are padding).
      scale: multiplies the products of q with the state and with k.
      output_final_state: also return the final states.

    Returns:
      (o [B, H, Tp, Vp] in v's dtype, ht [B, H, Vp, Kp] float32 or None). Under `jax.vmap` the
      mapped axis folds into B (`gla_core.pallas_transforms.fold_vmap`; a mapped gamma runs
      the kernel once per mapped element).
    """
    launch = functools.partial(
        _launch,
        specs=specs,
        seq_len=seq_len,
        scale=scale,
        output_final_state=output_final_state,
        interpret=interpret,
    )
    o, ht = fold_vmap(launch, (q, k, v, gamma, h0), in_axes=(0, 0, 0, None, 0), out_axes=0)
    return o, ht


def _launch(q, k, v, gamma, h0, *, specs: GammaSpecs, seq_len: int, scale: float, output_final_state: bool, interpret):
    b, h, tp, kdim = q.shape
    vdim = v.shape[-1]
    grid = specs.grid(b, h, vdim)
    has_h0 = h0 is not None
    in_specs = [specs.gamma(), specs.key(), specs.key(), specs.value()]
    inputs = [gamma, q, k, v]
    if has_h0:
        in_specs.append(specs.state())
        inputs.append(h0)
    out_shape = [jax.ShapeDtypeStruct((b, h, tp, vdim), v.dtype)]
    out_specs = [specs.value()]
    if output_final_state:
        out_shape.append(jax.ShapeDtypeStruct((b, h, vdim, kdim), jnp.float32))
        out_specs.append(specs.state())
    kernel = functools.partial(
        _forward_kernel,
        has_h0=has_h0,
        has_ht=output_final_state,
        scale=scale,
        seq_len=seq_len,
        num_chunks=specs.num_chunks,
        dtype=mxu_dtype(q.dtype),
    )
    c, nv = specs.chunk, grid[2]
    tiles = b * h * nv * specs.num_chunks
    # per chunk and V tile: q.S, q.k^T, scores.v, the state update
    flops = tiles * (2 * c * kdim * specs.block_v * 2 + 2 * c * c * (kdim + specs.block_v))
    transcendentals = tiles * (c * c + 2 * c + 1)
    with jax.named_scope(NAME):
        outs = pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((specs.block_v, kdim), jnp.float32)],
            compiler_params=compiler_params("parallel", "parallel", "parallel", "arbitrary"),
            interpret=interpret_params(interpret),
            cost_estimate=cost_estimate(flops, transcendentals, [q, k, v, gamma, h0, *out_shape]),
            name=NAME,
        )(*inputs)
    return outs[0], (outs[1] if output_final_state else None)
