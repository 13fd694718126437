"""`fused_chunk_bwd_dhdv`: pass 1 of the split backward, sequential backwards in time.

With `G` the gradient of the state a chunk produces (stored transposed, `[V, K]`), per chunk
from the last to the first:

    dh_c   = G                                                    (materialized, float32)
    dv_s   = (k_s * e^{b_L - b_s}) G  +  scale * sum_{t>=s} (q_t . k_s) e^{b_t - b_s} do_t
    G     <- e^{b_L} G + scale * sum_t (q_t * e^{b_t}) do_t^T

`G` starts from the final-state cotangent `dht` (or zero) and stays in VMEM; after the first
chunk it is the initial-state gradient `dh0`. The grid is (B, H, NV, NT / num_steps) with the
time axis walked backwards through the index maps. Every grid iteration computes what does not
depend on the carried gradient for all its `num_steps` chunks at once, with matmuls batched over
the chunk axis; only the recurrence of G walks the chunks (elementwise, last chunk first).

The per-chunk gradients `dh` [B, H, NT, V, K] are float32, like the recomputed states `h`:
pass 2 (`gla_core.chunk.bwd_dqkg.chunk_bwd_dqkg`, parallel over time) takes float32 states and
gradients, uses full-precision matmuls on them for float32 inputs, and forms the gate
gradient from the elementwise float32 product `e^{b_L} * sum_v S * G`, summed over the
whole sequence for g_gamma. Rounding G to bfloat16 would put a relative 2^-9 error on every
term, far above the 1e-4 float32 gradient tolerance; the price is the same HBM traffic as
the plain chunk path's `dh`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_core.kit import BATCHED_NT, BATCHED_TN, ChunkMasks, dot, fold_vmap, mxu_dtype
from gla_fused.fused_chunk.block_gate import BlockGate
from gla_fused.fused_chunk.launch import sequential_call
from gla_fused.fused_chunk.specs import FusedSpecs

F32 = jnp.float32


def _bwd_dhdv_kernel(*refs, num_steps, chunk, has_dht, has_dh0, scale, dtype):
    q_ref, k_ref, do_ref, gate_ref = refs[:4]  # [S*C, K], [S*C, K], [S*C, Vt], [S, 1, C]
    dht_ref = refs[4] if has_dht else None  # [Vt, K]
    outs = refs[4 + has_dht :]
    dv_ref, dh_ref = outs[0], outs[1]  # [S*C, Vt]; [S, Vt, K] gradients of the states after each chunk
    dh0_ref = outs[2] if has_dh0 else None  # [Vt, K]
    grad_ref = outs[-1]  # VMEM scratch [Vt, K] float32
    step = pl.program_id(3)

    @pl.when(step == 0)
    def _start():
        grad_ref[...] = dht_ref[...].astype(F32) if has_dht else jnp.zeros(grad_ref.shape, F32)

    n, c = num_steps, chunk
    masks = ChunkMasks(c)
    gate = BlockGate(gate_ref[...].reshape(n, c), masks)
    from_start, to_end = gate.from_start, gate.to_end
    q = q_ref[...].reshape(n, c, q_ref.shape[-1])
    k = k_ref[...].reshape(n, c, k_ref.shape[-1])
    do = do_ref[...].reshape(n, c, do_ref.shape[-1])
    # Every chunk at once, batched over the chunk axis: the intra-chunk part of dv and each chunk's
    # contribution to the state gradient.
    intra = dot(gate.scores(q, k, dtype), do, BATCHED_TN, dtype)  # [S, C, Vt]: sum_{t>=s} scores_ts do_t
    contributions = scale * dot(do, q.astype(F32) * from_start, BATCHED_TN, dtype)  # [S, Vt, K]
    # The only sequential part, last chunk first: the gradient of the state after each chunk.
    grad = grad_ref[...]
    grads = [None] * n
    for s in reversed(range(n)):
        grads[s] = grad
        grad = grad * gate.last[s : s + 1, :] + contributions[s]
    after = jnp.stack(grads)  # [S, Vt, K]
    dh_ref[...] = after
    from_state = dot(k.astype(F32) * to_end, after, BATCHED_NT, dtype)  # [S, C, Vt]
    dv_ref[...] = (from_state + scale * intra).reshape(n * c, -1).astype(dv_ref.dtype)
    grad_ref[...] = grad

    if has_dh0:

        @pl.when(step == pl.num_programs(3) - 1)
        def _initial():
            dh0_ref[...] = grad


def fused_chunk_bwd_dhdv(q, k, do, gate, dht, *, specs: FusedSpecs, scale: float, need_dh0: bool, interpret: bool):
    """Value gradients, per-chunk state gradients and initial-state gradients.

    Args:
      q, k: [B, H, Tp, K]; do: [B, H, Tp, V] (the cotangent of o, compute dtype).
      gate: per-step log decays [B, H, NT, 1, C] float32.
      dht: [B, H, V, K] float32 cotangent of the final states, or None (zero).
      specs: block shapes of this call walking time backwards (`FusedSpecs.reversed()`).
      need_dh0: also return the initial-state gradients.

    Returns:
      (dv [B, H, Tp, V] in q's dtype, dh [B, H, NT, V, K] float32 gradients of the state
      after every chunk, dh0 [B, H, V, K] float32 or None). Under `jax.vmap` the mapped axis
      folds into B (`gla_core.pallas_transforms.fold_vmap`).
    """
    if not specs.reverse:
        raise ValueError("fused_chunk_bwd_dhdv needs reverse-time specs")
    launch = functools.partial(_launch, specs=specs, scale=scale, need_dh0=need_dh0, interpret=interpret)
    dv, dh, dh0 = fold_vmap(launch, (q, k, do, gate, dht), in_axes=(0,) * 5, out_axes=0)
    return dv, dh, dh0


def _launch(q, k, do, gate, dht, *, specs: FusedSpecs, scale: float, need_dh0: bool, interpret: bool):
    b, hh, tp, kdim = q.shape
    vdim = do.shape[-1]
    c, nt = specs.chunk, specs.num_chunks
    has_dht = dht is not None
    in_specs = [specs.key(), specs.key(), specs.value(), specs.gate()]
    inputs = [q, k, do, gate]
    if has_dht:
        in_specs.append(specs.state())
        inputs.append(dht)
    out_shape = [
        jax.ShapeDtypeStruct((b, hh, tp, vdim), q.dtype),
        jax.ShapeDtypeStruct((b, hh, nt, vdim, kdim), F32),
    ]
    out_specs = [specs.value(), specs.chunk_states()]
    if need_dh0:
        out_shape.append(jax.ShapeDtypeStruct((b, hh, vdim, kdim), F32))
        out_specs.append(specs.state())
    kernel = functools.partial(
        _bwd_dhdv_kernel,
        num_steps=specs.num_steps,
        chunk=c,
        has_dht=has_dht,
        has_dh0=need_dh0,
        scale=scale,
        dtype=mxu_dtype(q.dtype),
    )
    outs = sequential_call(
        kernel, "fused_chunk_bwd_dhdv", inputs, in_specs, out_shape, out_specs, specs=specs, interpret=interpret
    )
    return outs[0], outs[1], (outs[2] if need_dh0 else None)
