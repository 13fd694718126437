"""`token_fwd`: the forward of the chunk op (per-key or scalar gate) on the op's own token-major arrays.

The math of `step_math` (anchored products, recomputed exactly out of range, masked for
non-finite values), one grid step per n chunks of all heads of a batch row (`heads`): q, k, v and
the gate are read and o written through the free `[B, T*H, D]` views, the states of all heads
carried in VMEM along the time axis ("arbitrary"; batch rows "parallel"). For the backward the
kernel also keeps every chunk's intra-chunk scores and the state before every chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_core.chunk.anchored import StepDecays
from gla_core.chunk.common import cost_estimate
from gla_core.chunk.gates import intra_costs, mask_table_inputs
from gla_core.chunk.heads import TokenGeometry, chunks_first, load_gate, load_heads, store_heads, token_call
from gla_core.chunk.step_math import ForwardStep, run_forward


def _forward_kernel(*refs, geo: TokenGeometry, has_h0, has_ht, keep, scale, dtype, anchor_range):
    q_ref, k_ref, v_ref, gate_ref = refs[:4]  # [1, n*C*H, K] x2, [1, n*C*H, V], [1, n*C*H, K] float32
    h0_ref = refs[4] if has_h0 else None  # [H, V, K] float32
    table_ref = refs[4 + has_h0]  # the key mask table
    o_ref = refs[5 + has_h0]  # [1, n*C*H, V]
    scores_ref, states_ref = refs[6 + has_h0 : 8 + has_h0] if keep else (None, None)  # [n, H, C, C], [n, H, V, K]
    ht_ref = refs[6 + has_h0 + 2 * keep] if has_ht else None  # [H, V, K]
    state_ref = refs[-1]  # VMEM scratch [H, V, K] float32: the states of all heads
    step = pl.program_id(1)

    @pl.when(step == 0)
    def _start():
        state_ref[...] = h0_ref[...] if has_h0 else jnp.zeros(state_ref.shape, jnp.float32)

    q = load_heads(q_ref, geo, jnp.float32)  # [H*n, C, K]
    k = load_heads(k_ref, geo, jnp.float32)
    v = load_heads(v_ref, geo)  # [H*n, C, V]
    gates = load_gate(gate_ref, geo, q.shape[-1])  # [H*n, C, K] float32
    a = gates.reshape(-1, gates.shape[-1])
    decays = StepDecays(a, table_ref, geo.chunk, anchor_range if anchor_range > 0 else None)

    def write(result: ForwardStep, o):
        store_heads(o_ref, o, geo)
        if keep:
            scores_ref[...] = chunks_first(result.scores, geo.num_heads).astype(scores_ref.dtype)
            states_ref[...] = chunks_first(result.states, geo.num_heads)
        state_ref[...] = result.end

        if has_ht:

            @pl.when(step == pl.num_programs(1) - 1)
            def _final():
                ht_ref[...] = result.end

    run_forward(decays, a, table_ref, q, k, v, state_ref[...], write, scale=scale, dtype=dtype, chunk=geo.chunk)


def token_fwd(
    q, k, v, gate, h0, *, geo: TokenGeometry, scale: float, output_final_state: bool, keep: bool, anchor_range: float
):
    """Outputs, final states and (with `keep`, for the backward) every chunk's scores and first state.

    Args:
      q, k: [B, T*H, K] (the merged view of [B, T, H, K]); v: [B, T*H, V]; gate: float32 per-step
        log decays (floored, `gates.floor_gates`), [B, T*H, K] per key or [B, T, H] for
        `geo.scalar_gate`; h0: [B, H, V, K] float32 or None.
      geo: the call's `TokenGeometry` (forward in time).
      anchor_range: the largest |D| of the anchored products (`anchored.StepDecays`); 0 takes the
        exact level products everywhere.

    Returns:
      (o [B, T*H, V] in v's dtype, ht [B, H, V, K] float32 or None, scores [B, NT, H, C, C] in the
      MXU dtype or None, states [B, NT, H, V, K] float32 or None).
    """
    b, rows, kdim = q.shape
    vdim = v.shape[-1]
    h, nt, c = geo.num_heads, geo.num_chunks, geo.chunk
    dtype = jnp.bfloat16 if q.dtype == jnp.bfloat16 else jnp.float32
    table, table_spec = mask_table_inputs("key", c)
    inputs, in_specs = [q, k, v, gate], [geo.rows(kdim), geo.rows(kdim), geo.rows(vdim), geo.gate_rows(kdim)]
    if h0 is not None:
        inputs.append(h0)
        in_specs.append(geo.per_sequence())
    inputs += table
    in_specs += table_spec
    out_shape = [jax.ShapeDtypeStruct((b, rows, vdim), v.dtype)]
    out_specs = [geo.rows(vdim)]
    if keep:
        out_shape += [
            jax.ShapeDtypeStruct((b, nt, h, c, c), dtype),
            jax.ShapeDtypeStruct((b, nt, h, vdim, kdim), jnp.float32),
        ]
        out_specs += [geo.per_chunk(c, c), geo.per_chunk(vdim, kdim)]
    if output_final_state:
        out_shape.append(jax.ShapeDtypeStruct((b, h, vdim, kdim), jnp.float32))
        out_specs.append(geo.per_sequence())
    gate_flops, transcendentals = intra_costs("key", c, kdim, products=1, anchored=anchor_range > 0)
    per_chunk = 4 * c * kdim * vdim + 2 * c * c * vdim + 3 * kdim * vdim
    cost = cost_estimate(b * h * nt * (gate_flops + per_chunk), b * h * nt * transcendentals, [*inputs, *out_shape])
    kernel = functools.partial(
        _forward_kernel,
        geo=geo,
        has_h0=h0 is not None,
        has_ht=output_final_state,
        keep=keep,
        scale=scale,
        dtype=dtype,
        anchor_range=anchor_range,
    )
    outs = token_call(kernel, geo, inputs, in_specs, out_shape, out_specs, cost=cost, name="chunk_fwd")
    o = outs[0]
    scores, states = (outs[1], outs[2]) if keep else (None, None)
    ht = outs[-1] if output_final_state else None
    return o, ht, scores, states
