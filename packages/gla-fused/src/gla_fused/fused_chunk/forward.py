"""`fused_chunk_fwd`: the whole forward in one kernel, the state carried in VMEM, `o` written directly.

Per chunk (b_t the sum of the chunk's log decays through step t, L its last step, S the
state before the chunk, stored transposed `[V, K]`):

    o_t = scale * ( (q_t * e^{b_t}) S  +  sum_{s<=t} (q_t . k_s) e^{b_t - b_s} v_s )
    S  <- e^{b_L} S + sum_t (k_t * e^{b_L - b_t}) v_t^T

The grid is (B, H, NV, NT / num_steps): batch, heads and V tiles are parallel, time is
sequential ("arbitrary"). Each grid iteration loads `num_steps` consecutive chunks and
computes everything that does not depend on the carried state for all of them at once, with
matmuls batched over the chunk axis (decays, scores, intra-chunk outputs, each chunk's state
contribution); only the state recurrence itself, an elementwise update, walks the chunks in
order, and one more batched matmul applies each chunk's incoming state. Dependent chains of
small matmuls per chunk (the previous form) cost 3-4x more by libtpu's static estimate. The
per-chunk states never leave VMEM (the plain chunk path writes them to HBM for a second
kernel to read). The state starts from `initial_state` (or zero) at the first iteration; the
final state is written at the last one. States are float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_core.kit import BATCHED_NN, BATCHED_NT, BATCHED_TN, NN, ChunkMasks, dot, fold_vmap, mxu_dtype
from gla_fused.fused_chunk.block_gate import BlockGate, rows_to_columns
from gla_fused.fused_chunk.launch import sequential_call
from gla_fused.fused_chunk.specs import FusedSpecs

F32 = jnp.float32


def _fwd_kernel(*refs, num_steps, chunk, has_h0, has_ht, scale, dtype):
    q_ref, k_ref, v_ref, gate_ref = refs[:4]  # [S*C, K], [S*C, K], [S*C, Vt], [S, 1, C]
    h0_ref = refs[4] if has_h0 else None  # [Vt, K]
    o_ref = refs[4 + has_h0]  # [S*C, Vt]
    ht_ref = refs[5 + has_h0] if has_ht else None  # [Vt, K]
    state_ref = refs[-1]  # VMEM scratch [Vt, K] float32
    step = pl.program_id(3)

    @pl.when(step == 0)
    def _start():
        state_ref[...] = h0_ref[...].astype(F32) if has_h0 else jnp.zeros(state_ref.shape, F32)

    n, c = num_steps, chunk
    masks = ChunkMasks(c)
    q = q_ref[...].reshape(n, c, q_ref.shape[-1])
    k = k_ref[...].reshape(n, c, k_ref.shape[-1])
    v = v_ref[...]
    gate = BlockGate(gate_ref[...].reshape(n, c), masks)  # per-step log decays, one row per chunk
    from_start, to_end = gate.from_start, gate.to_end
    # Every chunk of the iteration at once, batched over the chunk axis: scores, intra-chunk outputs
    # and each chunk's state contribution.
    finite = jnp.isfinite(v.astype(F32))
    v_finite = jnp.where(finite, v, jnp.zeros((), v.dtype)).reshape(n, c, v.shape[-1])
    intra = dot(gate.scores(q, k, dtype), v_finite, BATCHED_NN, dtype)  # [S, C, Vt]
    # A non-finite v_s reaches the rows t >= s of its chunk only (as `causal_dot`), later chunks through the state.
    bad_rows = jnp.max(jnp.where(finite, 0.0, 1.0), axis=1).reshape(n, c)
    bad = dot(bad_rows, masks.upper, NN, F32)  # > 0 from the first non-finite step of the chunk on
    contributions = dot(v.reshape(n, c, -1), k.astype(F32) * to_end, BATCHED_TN, dtype)  # [S, Vt, K]
    # The only sequential part: the state before each chunk, elementwise.
    state = state_ref[...]
    states = []
    for s in range(n):
        states.append(state)
        state = state * gate.last[s : s + 1, :] + contributions[s]
    state_ref[...] = state
    inter = dot(q.astype(F32) * from_start, jnp.stack(states), BATCHED_NT, dtype)  # [S, C, Vt]
    o = scale * (inter + intra)
    o = jnp.where(rows_to_columns(bad, masks.diagonal) > 0.0, jnp.nan, o)
    o_ref[...] = o.reshape(n * c, -1).astype(o_ref.dtype)

    if has_ht:

        @pl.when(step == pl.num_programs(3) - 1)
        def _final():
            ht_ref[...] = state


def fused_chunk_fwd(q, k, v, gate, h0, *, specs: FusedSpecs, scale: float, output_final_state: bool, interpret: bool):
    """Outputs and final states.

    Args:
      q, k: [B, H, Tp, K] (Tp = NT * C, K a multiple of 128); v: [B, H, Tp, V].
      gate: per-step log decays [B, H, NT, 1, C] float32.
      h0: [B, H, V, K] float32 initial states (transposed) or None.
      specs: block shapes of this call (forward in time).
      scale: multiplies the float32 accumulations of o.
      output_final_state: also return the final states.

    Returns:
      (o [B, H, Tp, V] in v's dtype, ht [B, H, V, K] float32 or None). Under `jax.vmap` the
      mapped axis folds into B (`gla_core.pallas_transforms.fold_vmap`).
    """
    if specs.reverse:
        raise ValueError("fused_chunk_fwd needs forward-time specs")
    launch = functools.partial(
        _launch, specs=specs, scale=scale, output_final_state=output_final_state, interpret=interpret
    )
    o, ht = fold_vmap(launch, (q, k, v, gate, h0), in_axes=(0,) * 5, out_axes=0)
    return o, ht


def _launch(q, k, v, gate, h0, *, specs: FusedSpecs, scale: float, output_final_state: bool, interpret: bool):
    b, hh, tp, kdim = q.shape
    vdim = v.shape[-1]
    c = specs.chunk
    has_h0 = h0 is not None
    in_specs = [specs.key(), specs.key(), specs.value(), specs.gate()]
    inputs = [q, k, v, gate]
    if has_h0:
        in_specs.append(specs.state())
        inputs.append(h0)
    out_shape = [jax.ShapeDtypeStruct((b, hh, tp, vdim), v.dtype)]
    out_specs = [specs.value()]
    if output_final_state:
        out_shape.append(jax.ShapeDtypeStruct((b, hh, vdim, kdim), F32))
        out_specs.append(specs.state())
    kernel = functools.partial(
        _fwd_kernel,
        num_steps=specs.num_steps,
        chunk=c,
        has_h0=has_h0,
        has_ht=output_final_state,
        scale=scale,
        dtype=mxu_dtype(q.dtype),
    )
    outs = sequential_call(
        kernel, "fused_chunk_fwd", inputs, in_specs, out_shape, out_specs, specs=specs, interpret=interpret
    )
    return outs[0], (outs[1] if output_final_state else None)
