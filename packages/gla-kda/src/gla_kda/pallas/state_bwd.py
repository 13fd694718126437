"""Backward reverse-time state-gradient kernel (the chunk-level adjoint of the state kernel).

Walking the chunks backwards with dS, the gradient of the state after the current chunk
(float32, carried in VMEM; starts as the final-state cotangent of its sequence, or zero):
  ddelta = Aqk^T dO + (k exp(G_last - G)) dS                           [C, V]
  dS    <- exp(G_last) * dS + scale (q exp(G))^T dO - w^T ddelta        (w = Tinv beta k exp(G))
It stores dS before the update (the gradient of the state after every chunk) and ddelta,
and, at the first chunk of each sequence, dS after the update: d initial_state.
Time runs backwards through the index maps (no flipped copies).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_core.kit import fold_vmap, row_to_column
from gla_kda.pallas import chunk_math as cm
from gla_kda.pallas.config import KernelConfig, compiler_params


@dataclasses.dataclass(frozen=True)
class StateGradOptions:
    """Optional inputs/outputs of the reverse kernel."""

    has_final_cotangent: bool
    emit_initial_grad: bool


def state_bwd_kernel(first_ref, last_ref, seq_ref, *refs, config: KernelConfig, options: StateGradOptions):
    """Blocks of n consecutive chunks of one sequence (visited last to first): q, k, g, g_lo [n*C, K];
    beta [n, 1, C]; tinv, aqk [n*C, C]; do [n*C, V]; dht [K, V].

    Outputs: dstate [n*K, V] (gradient of the state after each chunk), ddelta [n*C, V], dh0 [K, V];
    scratch dS [K, V] float32. Only the step's last chunk may end its sequence and only its first
    may start it (the launcher takes one chunk per step when sequences are packed).
    """
    del seq_ref
    refs = list(refs)
    q_ref, k_ref, g_ref, g_lo_ref, beta_ref, tinv_ref, aqk_ref, do_ref = refs[:8]
    dht_ref = refs[8] if options.has_final_cotangent else None
    rest = refs[8 + options.has_final_cotangent :]
    dstate_ref, ddelta_ref = rest[:2]
    dh0_ref = rest[2] if options.emit_initial_grad else None
    grad_ref = rest[-1]
    per_step = beta_ref.shape[0]
    c, key_dim = config.blocks.chunk_size, q_ref.shape[-1]
    sb = cm.SubBlocks(c, config.blocks.sub_chunk)
    t = pl.program_id(2)
    first_chunk = (pl.num_programs(2) - 1 - t) * per_step
    last_chunk = first_chunk + per_step - 1

    @pl.when((t == 0) | (last_ref[last_chunk] == 1))
    def _reset():
        grad_ref[...] = jnp.zeros(grad_ref.shape, grad_ref.dtype)

    if dht_ref is not None:

        @pl.when(last_ref[last_chunk] == 1)
        def _final_cotangent():
            grad_ref[...] = dht_ref[...].astype(cm.F32)

    dtype = config.mxu_dtype
    # What does not depend on dS, for every chunk first: it overlaps the serial chain below.
    terms = []
    for n in range(per_step):
        rows = pl.ds(n * c, c)
        q = q_ref[rows, :].astype(cm.F32) * config.scale
        k = k_ref[rows, :].astype(cm.F32)
        decays = cm.Decays(g_ref[rows, :], sb, g_lo_ref[rows, :])
        beta = row_to_column(beta_ref[n])
        do = do_ref[rows, :]
        decay = jnp.exp(decays.cum)
        terms.append(
            (
                cm.dot(aqk_ref[rows, :], do, dtype, trans_a=True),
                k * jnp.exp(decays.to_end),
                row_to_column(jnp.exp(decays.total)),
                cm.dot(q * decay, do, dtype, trans_a=True),
                cm.dot(tinv_ref[rows, :], beta * k * decay, dtype),
            )
        )
    grad = grad_ref[...]
    for n in reversed(range(per_step)):
        rows = pl.ds(n * c, c)
        from_output, k_to_end, total_decay, q_term, w = terms[n]
        dstate_ref[pl.ds(n * key_dim, key_dim), :] = grad.astype(dstate_ref.dtype)
        ddelta = from_output + cm.dot(k_to_end, grad, dtype)
        ddelta_ref[rows, :] = ddelta.astype(ddelta_ref.dtype)
        grad = total_decay * grad + q_term - cm.dot(w, ddelta, dtype, trans_a=True)
    grad_ref[...] = grad
    if dh0_ref is not None:

        @pl.when(first_ref[first_chunk] == 1)
        def _initial_grad():
            dh0_ref[...] = grad


def reversed_index(b, j, t, *_, num_steps: int):
    return (b, j, num_steps - 1 - t, 0)


def reversed_qk_index(b, j, t, *_, num_steps: int, group: int):
    return (b, jax.lax.div(j, jnp.int32(group)), num_steps - 1 - t, 0)


def reversed_beta_index(b, j, t, *_, num_steps: int):
    return (b, j, num_steps - 1 - t, 0, 0)


def reversed_sequence_index(b, j, t, first_ref, last_ref, seq_ref, *, num_steps: int, states_per_row: int):
    """Final/initial state block of the sequence owning step t's chunks (one sequence per step)."""
    per_step = first_ref.shape[0] // num_steps
    return (b * states_per_row + seq_ref[(num_steps - 1 - t) * per_step], j, 0, 0)


def state_bwd_cost(batch, heads, num_chunks, c, k, v, itemsize):
    steps = batch * heads * num_chunks
    flops = steps * (2 * c * c * v + 2 * c * k * v * 3 + 2 * c * c * k)
    bytes_accessed = steps * (
        2 * c * k * itemsize + 2 * c * k * 4 + c * 4 + 2 * c * c * 4 + c * v * itemsize + (k * v + c * v) * itemsize
    )
    return pl.CostEstimate(flops=flops, transcendentals=steps * (2 * c * k + k), bytes_accessed=bytes_accessed)


def launch_state_bwd(
    q, k, g, g_lo, beta, tinv, aqk, do, dht, meta, config: KernelConfig, emit_initial_grad: bool, states_per_row: int
):
    """Reverse-time state gradients.

    Args:
      q, k: [B, H, Tp, K]; g, g_lo: [B, HV, Tp, K] float32 sub-block-local decay cumsum
      (`layout.local_cumsum`); beta: [B, HV, NT, 1, C] float32;
      tinv, aqk: [B, HV, Tp, C] float32; do: [B, HV, Tp, V]; dht: [N, HV, K, V] float32 or None;
      meta: `ChunkMeta`. states_per_row: N / B.
    Returns:
      (dstate [B, HV, NT*K, V], ddelta [B, HV, Tp, V], dh0 [N, HV, K, V] float32 or None).
      Under `jax.vmap` the mapped axis folds into B and N (`gla_core.pallas_transforms.fold_vmap`).
    """
    launch = functools.partial(
        _launch_state_bwd, config=config, emit_initial_grad=emit_initial_grad, states_per_row=states_per_row
    )
    args = (q, k, g, g_lo, beta, tinv, aqk, do, dht, meta.first, meta.last, meta.seq)
    return fold_vmap(launch, args, in_axes=(0,) * 9 + (None,) * 3, out_axes=0)


def _launch_state_bwd(
    q, k, g, g_lo, beta, tinv, aqk, do, dht, first, last, seq, *, config, emit_initial_grad, states_per_row
):
    batch, heads, padded_len, key_dim = g.shape
    value_dim = do.shape[-1]
    c = config.blocks.chunk_size
    num_chunks = padded_len // c
    num_states = batch * states_per_row
    options = StateGradOptions(has_final_cotangent=dht is not None, emit_initial_grad=emit_initial_grad)
    per_step = 1 if states_per_row > 1 else config.blocks.per_step(num_chunks)
    num_steps, rows = num_chunks // per_step, per_step * c
    index = functools.partial(reversed_index, num_steps=num_steps)
    qk_spec = pl.BlockSpec(
        (None, None, rows, key_dim), functools.partial(reversed_qk_index, num_steps=num_steps, group=config.group)
    )
    state_spec = pl.BlockSpec(
        (None, None, key_dim, value_dim),
        functools.partial(reversed_sequence_index, num_steps=num_steps, states_per_row=states_per_row),
    )
    in_specs = [
        qk_spec,
        qk_spec,
        pl.BlockSpec((None, None, rows, key_dim), index),
        pl.BlockSpec((None, None, rows, key_dim), index),
        pl.BlockSpec((None, None, per_step, 1, c), functools.partial(reversed_beta_index, num_steps=num_steps)),
        pl.BlockSpec((None, None, rows, c), index),
        pl.BlockSpec((None, None, rows, c), index),
        pl.BlockSpec((None, None, rows, value_dim), index),
    ]
    args = [q, k, g, g_lo, beta, tinv, aqk, do]
    if dht is not None:
        in_specs.append(state_spec)
        args.append(dht)
    out_specs = [
        pl.BlockSpec((None, None, per_step * key_dim, value_dim), index),
        pl.BlockSpec((None, None, rows, value_dim), index),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((batch, heads, num_chunks * key_dim, value_dim), config.store_dtype),
        jax.ShapeDtypeStruct((batch, heads, padded_len, value_dim), config.store_dtype),
    ]
    if emit_initial_grad:
        out_specs.append(state_spec)
        out_shape.append(jax.ShapeDtypeStruct((num_states, heads, key_dim, value_dim), jnp.float32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(batch, heads, num_steps),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((key_dim, value_dim), jnp.float32)],
    )
    with jax.named_scope("kda_state_bwd"):
        results = pl.pallas_call(
            functools.partial(state_bwd_kernel, config=config, options=options),
            grid_spec=grid_spec,
            out_shape=out_shape,
            compiler_params=compiler_params(sequential_time=True),
            cost_estimate=state_bwd_cost(batch, heads, num_chunks, c, key_dim, value_dim, config.mxu_dtype.itemsize),
            interpret=config.interpret_arg,
            name="kda_state_bwd",
        )(first, last, seq, *args)
    dstate, ddelta = results[0], results[1]
    dh0 = results[2] if emit_initial_grad else None
    return dstate, ddelta, dh0
