"""`token_bwd`: the whole backward of the chunk op (per-key or scalar gate) on the op's own token-major arrays.

The math of `step_math` (the state-gradient chain and dv exact; dq, dk and the gate gradient with
the anchored products, recomputed exactly out of range), one grid step per n chunks of all heads
of a batch row, walking time backwards (`heads`): q, k, v, do and the gate are read and dq, dk,
dv and the gate gradient written through the free `[B, T*H, D]` views; the states and scores
the forward kept (`token_fwd(keep=True)`) are read once, and the state gradients of all heads stay
in VMEM.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_core.chunk.anchored import StepDecays
from gla_core.chunk.common import cost_estimate
from gla_core.chunk.gates import intra_costs, mask_table_inputs
from gla_core.chunk.heads import (
    TokenGeometry,
    heads_first,
    load_gate,
    load_heads,
    store_gate_grad,
    store_heads,
    token_call,
)
from gla_core.chunk.step_math import backward_step, run_gradients
from gla_core.token_major import heads_per_group

# Chunks of 128 and more: all heads' [C, C] temporaries at once need more scoped VMEM than the budget.
SPLIT_HEADS_FROM_CHUNK = 128


def head_groups(geo: TokenGeometry, group: int) -> int:
    """How many groups of heads the backward kernel takes one after the other in a grid step: two
    for a per-key gate at chunks of `SPLIT_HEADS_FROM_CHUNK` or more when the heads split into halves
    of whole `group`s (HeadRows' head pairs), else one."""
    halves = geo.num_heads % (2 * group) == 0
    return 2 if not geo.scalar_gate and geo.chunk >= SPLIT_HEADS_FROM_CHUNK and halves else 1


def _backward_kernel(*refs, geo: TokenGeometry, has_dht, has_dh0, scale, dtype, anchor_range, groups: int):
    q_ref, k_ref, v_ref, do_ref, gate_ref = refs[:5]  # [1, n*C*H, D] blocks (gate float32)
    states_ref, scores_ref = refs[5:7]  # [n, H, V, K] float32, [n, H, C, C]
    dht_ref = refs[7] if has_dht else None  # [H, V, K] float32
    table_ref = refs[7 + has_dht]  # the key mask table
    dq_ref, dk_ref, dv_ref, da_ref = refs[8 + has_dht : 12 + has_dht]  # [1, n*C*H, D] blocks
    dh0_ref = refs[12 + has_dht] if has_dh0 else None  # [H, V, K]
    grad_ref = refs[-1]  # VMEM scratch [H, V, K] float32: the gradients of the states after the step
    step = pl.program_id(1)

    @pl.when(step == 0)
    def _start():
        grad_ref[...] = dht_ref[...] if has_dht else jnp.zeros(grad_ref.shape, jnp.float32)

    size = geo.num_heads // groups
    for first in range(0, geo.num_heads, size):
        _heads_backward(
            range(first, first + size),
            (q_ref, k_ref, v_ref, do_ref, gate_ref, states_ref, scores_ref, table_ref),
            (dq_ref, dk_ref, dv_ref, da_ref, dh0_ref, grad_ref),
            geo=geo,
            scale=scale,
            dtype=dtype,
            anchor_range=anchor_range,
        )


def _heads_backward(heads: range, inputs, outputs, *, geo: TokenGeometry, scale, dtype, anchor_range):
    """The backward of one grid step for the heads `heads` (every head, or a group of whole head pairs)."""
    q_ref, k_ref, v_ref, do_ref, gate_ref, states_ref, scores_ref, table_ref = inputs
    dq_ref, dk_ref, dv_ref, da_ref, dh0_ref, grad_ref = outputs
    own = pl.ds(heads.start, len(heads))
    q = load_heads(q_ref, geo, jnp.float32, heads)  # [h*n, C, K]
    k = load_heads(k_ref, geo, jnp.float32, heads)
    v, do = load_heads(v_ref, geo, heads=heads), load_heads(do_ref, geo, heads=heads)  # [h*n, C, V]
    gates = load_gate(gate_ref, geo, q.shape[-1], heads)  # [h*n, C, K] float32
    a = gates.reshape(-1, gates.shape[-1])
    decays = StepDecays(a, table_ref, geo.chunk, anchor_range if anchor_range > 0 else None)
    states = heads_first(states_ref[:, own])  # [h*n, V, K]
    scores = heads_first(scores_ref[:, own])  # [h*n, C, C]
    result = backward_step(decays, q, k, do, scores, grad_ref[own], scale=scale, dtype=dtype)
    grad_ref[own] = result.end
    store_heads(dv_ref, result.dv, geo, heads)

    if dh0_ref is not None:

        @pl.when(pl.program_id(1) == pl.num_programs(1) - 1)
        def _initial():
            dh0_ref[own] = result.end

    def write(dq, dk, da):
        store_heads(dq_ref, dq, geo, heads)
        store_heads(dk_ref, dk, geo, heads)
        store_gate_grad(da_ref, da, geo, heads)

    operands = (gates, q, k, v, do, states, result.grads, table_ref)
    run_gradients(decays, a, table_ref, operands, write, scale=scale, dtype=dtype, chunk=geo.chunk)


def token_bwd(
    q,
    k,
    v,
    do,
    gate,
    states,
    scores,
    dht,
    *,
    geo: TokenGeometry,
    scale: float,
    need_dh0: bool,
    anchor_range: float,
):
    """dq, dk, dv, the gate gradient and the initial-state gradients.

    Args:
      q, k: [B, T*H, K]; v, do: [B, T*H, V]; gate: float32 as `token_fwd`'s;
      states, scores: what `token_fwd(keep=True)` kept; dht: [B, H, V, K] float32 or None (zero).
      geo: the call's `TokenGeometry` (forward in time; this walks it backwards).
      need_dh0: also return the initial-state gradients.
      anchor_range: as `token_fwd`.

    Returns:
      (dq, dk [B, T*H, K] in q's dtype, dv [B, T*H, V] in v's dtype, d/da float32 in the gate's
      layout ([B, T*H, K], or [B, T, H] summed over the keys for `geo.scalar_gate`),
      dh0 [B, H, V, K] float32 or None).
    """
    geo = dataclasses.replace(geo, reverse=True)
    b, _, kdim = q.shape
    vdim = v.shape[-1]
    h, nt, c = geo.num_heads, geo.num_chunks, geo.chunk
    dtype = jnp.bfloat16 if q.dtype == jnp.bfloat16 else jnp.float32
    table, table_spec = mask_table_inputs("key", c)
    inputs = [q, k, v, do, gate, states, scores]
    in_specs = [geo.rows(kdim), geo.rows(kdim), geo.rows(vdim), geo.rows(vdim), geo.gate_rows(kdim)]
    in_specs += [geo.per_chunk(vdim, kdim), geo.per_chunk(c, c)]
    if dht is not None:
        inputs.append(dht)
        in_specs.append(geo.per_sequence())
    inputs += table
    in_specs += table_spec
    out_shape = [
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        jax.ShapeDtypeStruct(gate.shape, jnp.float32),
    ]
    out_specs = [geo.rows(kdim), geo.rows(kdim), geo.rows(vdim), geo.gate_rows(kdim)]
    if need_dh0:
        out_shape.append(jax.ShapeDtypeStruct((b, h, vdim, kdim), jnp.float32))
        out_specs.append(geo.per_sequence())
    gate_flops, transcendentals = intra_costs("key", c, kdim, products=2, anchored=anchor_range > 0)
    # per chunk: the state-gradient update, dv, dq/dk inter, dq/dk/dgate intra, the gate's triangular sums
    per_chunk = 2 * c * kdim * vdim * 4 + 2 * c * c * vdim * 2 + 2 * 3 * 2 * c * c * kdim
    cost = cost_estimate(b * h * nt * (gate_flops + per_chunk), b * h * nt * transcendentals, [*inputs, *out_shape])
    kernel = functools.partial(
        _backward_kernel,
        geo=geo,
        has_dht=dht is not None,
        has_dh0=need_dh0,
        scale=scale,
        dtype=dtype,
        anchor_range=anchor_range,
        groups=head_groups(geo, heads_per_group(q.dtype)),
    )
    outs = token_call(kernel, geo, inputs, in_specs, out_shape, out_specs, cost=cost, name="chunk_bwd")
    dq, dk, dv, da = outs[:4]
    return dq, dk, dv, da, (outs[4] if need_dh0 else None)
