"""`fused_g_gamma_backward`: every gradient of simple_gla with only a constant decay, one kernel.

Grid `(B, H, NV, 2 NT)` (see `specs`). Chunk c, decays from `decay.ChunkDecay`, A = q k^T and
dA = do v^T recomputed in VMEM for every chunk (never stored), D the pair decays.

First half (steps 0..NT-1, chunks forwards) carries the state S_c and its derivative in
gamma, S'_c = dS_c/dgamma (both float32 VMEM, transposed `[Vt, Kp]`), from S_0 = h0, S'_0 = 0:

    dq_t    = scale * ( e^{b_t} do_t S_c^T + sum_{s<=t} D_ts dA_ts k_s )
    S_{c+1} = e^{gamma n} S_c + sum_s e^{gamma (n - p_s)} k_s v_s^T
    S'_{c+1} = e^{gamma n} (n S_c + S'_c) + sum_s (n - p_s) e^{gamma (n - p_s)} k_s v_s^T

and, since every step decays by the same gamma, dL/dgamma is the forward-mode derivative
of the loss along gamma:

    dL/dgamma = sum_t do_t . do_t/dgamma + <dht, S'_NT>
    do_t/dgamma = scale * ( p_t e^{b_t} q_t S_c + e^{b_t} q_t S'_c
                            + sum_{s<=t} (p_t - p_s) D_ts (q_t . k_s) v_s )

Every factor is a decay times a non-negative integer, so nothing overflows for gamma <= 0.

Second half (steps NT..2NT-1, chunks backwards) carries G_c = dL/dS_{c+1} in VMEM, from
G = dht (or 0):

    dv_s    = e^{gamma (n - p_s)} k_s G_c + scale * sum_{t>=s} D_ts A_ts do_t
    dk_s    = e^{gamma (n - p_s)} v_s G_c^T + scale * sum_{t>=s} D_ts dA_ts q_t
    G_{c-1} = e^{gamma n} G_c + scale * sum_t e^{b_t} q_t do_t^T,      dh0 = G_{-1}

With V tiled, dq, dk and d gamma are sums over the V tiles: each tile writes its own
partial sum (dq/dk `[B, H, NV, Tp, Kp]`, float32 unless NV = 1; d gamma one (8, 128) tile per
(b, h, V tile), every element the tile's total) and the caller adds them up.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_core.kit import NN, NT, TN, compiler_params, cost_estimate, dot, fold_vmap, interpret_params, mxu_dtype
from gla_fused.g_gamma.decay import ChunkDecay, valid_steps
from gla_fused.g_gamma.specs import PARTIAL_BLOCK, GammaSpecs

NAME = "fused_g_gamma_bwd"
F32 = jnp.float32


def _total(x: jax.Array) -> jax.Array:
    """Sum of a 2-D array as [1, 1]."""
    return jnp.sum(jnp.sum(x, axis=0, keepdims=True), axis=1, keepdims=True)


def _backward_kernel(gamma_ref, q_ref, k_ref, v_ref, do_ref, *refs, has_h0, has_dht, scale, seq_len, num_chunks, dtype):
    # gamma [H] (SMEM); q, k [C, Kp]; v, do [C, Vt]; h0, dht [Vt, Kp] float32
    h0_ref = refs[0] if has_h0 else None
    dht_ref = refs[has_h0] if has_dht else None
    outs = refs[has_h0 + has_dht :]
    dq_ref, dk_ref, dv_ref, dgamma_ref = outs[:4]  # [C, Kp], [C, Kp], [C, Vt], [8, 128]
    dh0_ref = outs[4] if has_h0 else None  # [Vt, Kp] float32
    # VMEM scratch: S_c, S'_c, G_c [Vt, Kp] and the running d gamma [8, 128], float32
    state_ref, tangent_ref, grad_ref, dgamma_acc_ref = outs[-4:]
    step = pl.program_id(3)
    chunk_index = jnp.minimum(step, 2 * num_chunks - 1 - step)
    chunk = q_ref.shape[0]

    def chunk_decay() -> ChunkDecay:
        # built inside each half: its lazily computed decays belong to that half's trace
        return ChunkDecay(gamma_ref[pl.program_id(1)], valid_steps(chunk_index, chunk, seq_len), chunk)

    q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    q32, k32 = q.astype(F32), k.astype(F32)
    scores = dot(q, k, NT, dtype)  # A [C, C]
    d_scores = dot(do, v, NT, dtype)  # dA [C, C]

    @pl.when(step == 0)
    def _start_forward_walk():
        state_ref[...] = h0_ref[...] if has_h0 else jnp.zeros(state_ref.shape, F32)
        tangent_ref[...] = jnp.zeros(tangent_ref.shape, F32)
        dgamma_acc_ref[...] = jnp.zeros(dgamma_acc_ref.shape, F32)

    @pl.when(step < num_chunks)
    def _forward_walk():
        decay = chunk_decay()
        state, tangent = state_ref[...], tangent_ref[...]
        dq_state = dot(do, state, NN, dtype) * decay.from_start  # e^{b_t} do_t S_c^T, [C, Kp]
        dq = scale * (dq_state + dot(decay.decayed(d_scores), k, NN, dtype))
        dq_ref[...] = dq.astype(dq_ref.dtype)
        # do_t . do_t/dgamma: through S_c, through S'_c, within the chunk
        tangent_out = dot(do, tangent, NN, dtype) * decay.from_start  # [C, Kp]
        through_states = _total(q32 * (decay.positions * dq_state + tangent_out))
        within = _total(scores * d_scores * decay.pairs_tangent)
        dgamma_acc_ref[...] += scale * (through_states + within)
        kv_tangent = dot(v, k32 * (decay.remaining * decay.to_end), TN, dtype)  # [Vt, Kp]
        tangent_ref[...] = decay.last * (decay.length * state + tangent) + kv_tangent
        state_ref[...] = decay.last * state + dot(v, k32 * decay.to_end, TN, dtype)

    @pl.when(step == num_chunks - 1)
    def _finish_forward_walk():
        if has_dht:
            dgamma_acc_ref[...] += _total(dht_ref[...] * tangent_ref[...])
        dgamma_ref[...] = dgamma_acc_ref[...]

    @pl.when(step == num_chunks)
    def _start_backward_walk():
        grad_ref[...] = dht_ref[...] if has_dht else jnp.zeros(grad_ref.shape, F32)

    @pl.when(step >= num_chunks)
    def _backward_walk():
        decay = chunk_decay()
        grad = grad_ref[...]
        k_decayed = k32 * decay.to_end
        dv = dot(k_decayed, grad, NT, dtype) + scale * dot(decay.decayed(scores), do, TN, dtype)
        dv_ref[...] = dv.astype(dv_ref.dtype)
        dk = dot(v, grad, NN, dtype) * decay.to_end + scale * dot(decay.decayed(d_scores), q, TN, dtype)
        dk_ref[...] = dk.astype(dk_ref.dtype)
        grad = decay.last * grad + scale * dot(do, q32 * decay.from_start, TN, dtype)
        grad_ref[...] = grad

        if has_h0:

            @pl.when(step == 2 * num_chunks - 1)
            def _initial_state_grad():
                dh0_ref[...] = grad


def fused_g_gamma_backward(
    q, k, v, do, gamma, h0, dht, *, specs: GammaSpecs, seq_len: int, scale: float, interpret: bool
):
    """Gradients of q, k, v, gamma and h0.

    Args:
      q, k: [B, H, Tp, Kp]; v, do: [B, H, Tp, Vp] (the forward's kernel inputs and the output
        cotangent, in the compute dtype).
      gamma: [H] float32; h0: [B, H, Vp, Kp] float32 or None; dht: [B, H, Vp, Kp] float32
        cotangent of the final states, or None (zero).
      specs: backward `GammaSpecs` (2 NT time steps); seq_len: T; scale: as in the forward.

    Returns:
      dq, dk: [B, H, NV, Tp, Kp] partial sums per V tile (float32 when NV > 1, else q's dtype);
      dv: [B, H, Tp, Vp] in v's dtype; dgamma: [B, H, NV, 8, 128] float32 partial sums per
      V tile (every element of a tile holds its sum); dh0: [B, H, Vp, Kp] float32 or None.
      Under `jax.vmap` the mapped axis folds into B (`gla_core.pallas_transforms.fold_vmap`;
      a mapped gamma runs the kernel once per mapped element).
    """
    if not specs.backward:
        raise ValueError("fused_g_gamma_backward needs backward GammaSpecs (2 NT time steps)")
    launch = functools.partial(_launch, specs=specs, seq_len=seq_len, scale=scale, interpret=interpret)
    args = (q, k, v, do, gamma, h0, dht)
    dq, dk, dv, dgamma, dh0 = fold_vmap(launch, args, in_axes=(0, 0, 0, 0, None, 0, 0), out_axes=0)
    return dq, dk, dv, dgamma, dh0


def _launch(q, k, v, do, gamma, h0, dht, *, specs: GammaSpecs, seq_len: int, scale: float, interpret: bool):
    b, h, tp, kdim = q.shape
    vdim = v.shape[-1]
    grid = specs.grid(b, h, vdim)
    nv = grid[2]
    has_h0, has_dht = h0 is not None, dht is not None
    in_specs = [specs.gamma(), specs.key(), specs.key(), specs.value(), specs.value()]
    inputs = [gamma, q, k, v, do]
    for state in (h0, dht):
        if state is not None:
            in_specs.append(specs.state())
            inputs.append(state)
    partial_dtype = q.dtype if nv == 1 else F32
    out_shape = [
        jax.ShapeDtypeStruct((b, h, nv, tp, kdim), partial_dtype),
        jax.ShapeDtypeStruct((b, h, nv, tp, kdim), partial_dtype),
        jax.ShapeDtypeStruct((b, h, tp, vdim), v.dtype),
        jax.ShapeDtypeStruct((b, h, nv, *PARTIAL_BLOCK), F32),
    ]
    out_specs = [specs.query_grad(), specs.key_grad(), specs.value_grad(), specs.gamma_grad()]
    if has_h0:
        out_shape.append(jax.ShapeDtypeStruct((b, h, vdim, kdim), F32))
        out_specs.append(specs.state())
    kernel = functools.partial(
        _backward_kernel,
        has_h0=has_h0,
        has_dht=has_dht,
        scale=scale,
        seq_len=seq_len,
        num_chunks=specs.num_chunks,
        dtype=mxu_dtype(q.dtype),
    )
    c, bv = specs.chunk, specs.block_v
    tiles = b * h * nv * specs.num_chunks
    # per chunk and V tile: A and dA in both halves; first half dq (2), S' product, S and S'
    # updates; second half dv (2), dk (2), G update
    flops = tiles * (4 * c * c * (kdim + bv) + 2 * c * c * kdim + 2 * c * c * (kdim + bv) + 2 * c * kdim * bv * 7)
    transcendentals = tiles * 2 * (c * c + 2 * c + 1)
    scratch = [pltpu.VMEM((specs.block_v, kdim), F32) for _ in range(3)] + [pltpu.VMEM(PARTIAL_BLOCK, F32)]
    with jax.named_scope(NAME):
        outs = pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
            compiler_params=compiler_params("parallel", "parallel", "parallel", "arbitrary"),
            interpret=interpret_params(interpret),
            cost_estimate=cost_estimate(flops, transcendentals, [*inputs, *out_shape]),
            name=NAME,
        )(*inputs)
    dq, dk, dv, dgamma = outs[:4]
    return dq, dk, dv, dgamma, (outs[4] if has_h0 else None)
