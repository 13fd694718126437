"""Backward reverse-time state-gradient kernel (the chunk-level adjoint of the state kernel).

Walking the chunks backwards with dS, the gradient of the state after the current chunk
(float32, carried in VMEM; starts as the final-state cotangent of its sequence, or zero):
  ddelta = Aqk^T dO + (k exp(G_last - G)) dS                           [C, V]
  dS    <- exp(G_last) * dS + scale (q exp(G))^T dO - w^T ddelta        (w = Tinv beta k exp(G))
It stores dS before the update (the gradient of the state after every chunk) and ddelta,
and, at the first chunk of each sequence, dS after the update: d initial_state.
Time runs backwards through the index maps (no flipped copies). Packed sequences start and end at
any chunk of a grid step: their final-state cotangents and initial-state gradients move by DMA
(`sequence_states`, walking backwards).

A grid step takes m value heads (`BlockSizes.state_grad_heads_per_step`) whose chains of
dependent products interleave, issued stage by stage over the heads (`state.wy_deltas`). It has
the block layouts of the forward state kernel (`state`) so libtpu's static cost model estimates
the kernel: q, k, dO and g (raw per-step log decays, cleaned and cumsummed here as in the forward
kernels) are read and dstate, ddelta written token-major ([rows, m*D] blocks), and the head-major
beta, tinv and aqk are read as m one-head blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_core.kit import KERNEL_VMEM_BUDGET_BYTES, fold_vmap, row_to_column
from gla_kda.pallas import chunk_math as cm
from gla_kda.pallas import poison as nf
from gla_kda.pallas.config import KernelConfig, compiler_params, head_index, token_block
from gla_kda.pallas.sequence_states import (
    SequenceStates,
    from_kernel_states,
    kernel_states_shape,
    resident_states,
    sequence_scratch,
    state_spec,
    to_kernel_states,
)
from gla_kda.pallas.state import heads_per_step


@dataclasses.dataclass(frozen=True)
class StateGradOptions:
    """Optional inputs/outputs of the reverse kernel."""

    has_final_cotangent: bool
    emit_initial_grad: bool


def state_bwd_kernel(
    first_ref,
    last_ref,
    seq_ref,
    *refs,
    config: KernelConfig,
    options: StateGradOptions,
    heads: int,
    states_per_row: int,
    packed: bool,
    resident: bool = False,
):
    """Blocks of n consecutive chunks (visited last to first) and m = `heads` value heads (head i of
    the step at lanes i*K.. / i*V..): q, k [n*C, m*K] (input dtype, non-finite entries read as 0);
    g [n*C, m*K] raw per-step log decays (`chunk_math.Decays.of_steps`); do [n*C, m*V] (poisoned
    here as the forward poisoned o: `gla_kda.pallas.poison`) and its poison rows [n*8, m*V]; m refs
    each (one per head) of beta [n, 1, C] (non-finite entries read as 0), tinv [n*C, C] and aqk
    [n*C, C]; dht [m, K, V], or with `packed` the row's
    per-sequence states (`sequence_states.state_spec`; in VMEM when `resident`).

    Outputs: dstate [n*K, m*V] (gradient of the state after each chunk), ddelta [n*C, m*V],
    dh0 [m, K, V] (`packed`: per sequence, as dht); scratch dS [m, K, V] float32, and with
    `packed` `sequence_scratch`. Without `packed` (one sequence per batch row) only the
    step's last chunk may end its sequence and only its first may start it.
    """
    refs = list(refs)
    q_ref, k_ref, g_ref, do_ref, poison_ref = refs[:5]
    head_refs = [refs[5 + 3 * i : 8 + 3 * i] for i in range(heads)]  # beta, tinv, aqk
    rest = refs[5 + 3 * heads :]
    dht_ref = rest.pop(0) if options.has_final_cotangent else None
    dstate_ref, ddelta_ref = rest.pop(0), rest.pop(0)
    dh0_ref = rest.pop(0) if options.emit_initial_grad else None
    grad_ref = rest.pop(0)
    per_step = head_refs[0][0].shape[0]
    c, key_dim, value_dim = config.blocks.chunk_size, grad_ref.shape[1], grad_ref.shape[2]
    sb = cm.SubBlocks(c, config.blocks.sub_chunk)
    t = pl.program_id(2)
    first_chunk = (pl.num_programs(2) - 1 - t) * per_step
    last_chunk = first_chunk + per_step - 1
    sequences = None
    if packed:  # walking backwards, a sequence starts at its last chunk and ends at its first
        sequences = SequenceStates(
            last_ref, first_ref, seq_ref, dht_ref, dh0_ref, tuple(rest), first_chunk, states_per_row, resident
        )
        sequences.load()

    # Packed sequences restart chunk by chunk (`SequenceStates.restart`) from a zero row end.
    starts_row = (t == 0) if packed else (t == 0) | (last_ref[last_chunk] == 1)

    @pl.when(starts_row)
    def _reset():
        grad_ref[...] = jnp.zeros(grad_ref.shape, grad_ref.dtype)

    if dht_ref is not None and not packed:

        @pl.when(last_ref[last_chunk] == 1)
        def _final_cotangent():
            grad_ref[...] = dht_ref[...].astype(cm.F32)

    dtype = config.mxu_dtype

    def terms(i, n):
        """What chunk n of head i needs besides dS: off the serial chain, formed next to its use
        (all of them formed first held m*n chunks of terms at once: 135k instead of 123k cycles
        at m = 2, B=1 T=1024 H=16)."""
        beta_ref, tinv_ref, aqk_ref = head_refs[i]
        rows, keys, values = pl.ds(n * c, c), pl.ds(i * key_dim, key_dim), pl.ds(i * value_dim, value_dim)
        raw_q = q_ref[rows, keys]
        q = cm.finite(raw_q) * config.scale
        k = cm.finite(k_ref[rows, keys])
        decays = cm.Decays.of_steps(g_ref[rows, keys], sb, config.compensated_decays)
        beta = row_to_column(cm.finite(beta_ref[n]))
        do = nf.poison_chunk(do_ref[rows, values], poison_ref, n, raw_q, values)
        decay = jnp.exp(decays.cum)
        return (
            cm.dot(aqk_ref[rows, :], do, dtype, trans_a=True),
            k * jnp.exp(decays.to_end),
            row_to_column(jnp.exp(decays.total)),
            cm.dot(q * decay, do, dtype, trans_a=True),
            cm.dot(tinv_ref[rows, :], beta * k * decay, dtype),
        )

    grads = [grad_ref[i] for i in range(heads)]
    for n in reversed(range(per_step)):
        rows = pl.ds(n * c, c)
        if sequences is not None:
            grads = sequences.restart(n, grads)
        # Stage by stage over the heads: every ddelta before any state update (`state.wy_deltas`).
        chunk_terms = [terms(i, n) for i in range(heads)]
        ddeltas = []
        for i, (from_output, k_to_end, _, _, _) in enumerate(chunk_terms):
            values = pl.ds(i * value_dim, value_dim)
            dstate_ref[pl.ds(n * key_dim, key_dim), values] = grads[i].astype(dstate_ref.dtype)
            ddeltas.append(from_output + cm.dot(k_to_end, grads[i], dtype))
        for i, ((_, _, total_decay, q_term, w), ddelta) in enumerate(zip(chunk_terms, ddeltas, strict=True)):
            ddelta_ref[rows, pl.ds(i * value_dim, value_dim)] = ddelta.astype(ddelta_ref.dtype)
            grads[i] = total_decay * grads[i] + q_term - cm.dot(w, ddelta, dtype, trans_a=True)
        if sequences is not None:
            sequences.keep(n, grads)
    if sequences is not None:
        sequences.store()
    for i in range(heads):
        grad_ref[i] = grads[i]
    if dh0_ref is not None and not packed:

        @pl.when(first_ref[first_chunk] == 1)
        def _initial_grad():
            for i in range(heads):
                dh0_ref[i] = grads[i]


def state_bwd_cost(batch, heads, num_chunks, c, k, v, itemsize):
    steps = batch * heads * num_chunks
    flops = steps * (2 * c * c * v + 2 * c * k * v * 3 + 2 * c * c * k)
    bytes_accessed = steps * (
        2 * c * k * itemsize
        + c * k * 4
        + c * 4
        + c * c * (4 + itemsize)
        + c * v * itemsize
        + (k * v + c * v) * itemsize
    )
    return pl.CostEstimate(flops=flops, transcendentals=steps * (2 * c * k + k), bytes_accessed=bytes_accessed)


def launch_state_bwd(
    q,
    k,
    g,
    beta,
    tinv,
    aqk,
    do,
    poison_rows,
    dht,
    meta,
    config: KernelConfig,
    emit_initial_grad: bool,
    states_per_row: int,
    varlen: bool,
):
    """Reverse-time state gradients.

    Args:
      q, k: [B, Tp, H*K] (input dtype, token-major, `layout.to_tokens`; non-finite entries read as 0);
      g: [B, Tp, HV*K] float32 raw per-step log decays (token-major, cleaned as the forward kernels
      clean them); do: [B, Tp, HV*V] (token-major) and the forward's poison rows [B, NT*8, HV*V]
      (`gla_kda.pallas.poison`); beta: [B, HV, NT, 1, C] float32 (non-finite entries read as 0);
      tinv, aqk: [B, HV, Tp, C] (`launch_intra`); dht: [N, HV, K, V] float32 or None;
      meta: `ChunkMeta`. states_per_row: N / B. varlen: sequences may start and end at any chunk
      (`PipelineConfig.varlen`): their states move by DMA (`sequence_states`).
    Returns:
      (dstate [B, NT*K, HV*V] (rows n*K.. the gradient of the state after chunk n; lanes j*V..
      value head j), ddelta [B, Tp, HV*V] (token-major), dh0 [N, HV, K, V] float32 or None).
      Under `jax.vmap` the mapped axis folds into B and N (`gla_core.pallas_transforms.fold_vmap`).
    """
    launch = functools.partial(
        _launch_state_bwd,
        config=config,
        emit_initial_grad=emit_initial_grad,
        states_per_row=states_per_row,
        varlen=varlen,
    )
    args = (q, k, g, beta, tinv, aqk, do, poison_rows, dht, meta.first, meta.last, meta.seq)
    return fold_vmap(launch, args, in_axes=(0,) * 9 + (None,) * 3, out_axes=0)


def _launch_state_bwd(
    q,
    k,
    g,
    beta,
    tinv,
    aqk,
    do,
    poison_rows,
    dht,
    first,
    last,
    seq,
    *,
    config,
    emit_initial_grad,
    states_per_row,
    varlen,
):
    batch, heads = beta.shape[:2]
    padded_len, key_dim = g.shape[1], g.shape[2] // heads
    value_dim = do.shape[-1] // heads
    c = config.blocks.chunk_size
    num_chunks = padded_len // c
    num_states = batch * states_per_row
    options = StateGradOptions(has_final_cotangent=dht is not None, emit_initial_grad=emit_initial_grad)
    per_step = config.blocks.per_step(num_chunks)
    num_steps, rows = num_chunks // per_step, per_step * c
    m = heads_per_step(heads, config.group, config.blocks.state_grad_heads_per_step)
    sequence_spec = state_spec(varlen, m, key_dim, value_dim, states_per_row)
    resident = resident_states(varlen, states_per_row, m, key_dim, value_dim)
    # Head-major inputs as m one-head blocks (m-head blocks of them moving along the sequential
    # time axis make libtpu's static profile estimate 0 cycles; see `state`).
    head_specs, head_args = [], []
    for i in range(m):
        head_specs += [
            pl.BlockSpec((None, None, per_step, 1, c), head_index(i, m, 5, num_steps)),
            pl.BlockSpec((None, None, rows, c), head_index(i, m, 4, num_steps)),
            pl.BlockSpec((None, None, rows, c), head_index(i, m, 4, num_steps)),
        ]
        head_args += [beta, tinv, aqk]
    in_specs = [
        token_block(rows, m * key_dim, config.group, num_steps),
        token_block(rows, m * key_dim, config.group, num_steps),
        token_block(rows, m * key_dim, num_steps=num_steps),
        token_block(rows, m * value_dim, num_steps=num_steps),
        token_block(per_step * nf.ROWS_PER_CHUNK, m * value_dim, num_steps=num_steps),
        *head_specs,
    ]
    args = [q, k, g, do, poison_rows, *head_args]
    if dht is not None:
        in_specs.append(sequence_spec)
        args.append(to_kernel_states(dht, resident))
    out_specs = [
        token_block(per_step * key_dim, m * value_dim, num_steps=num_steps),
        token_block(rows, m * value_dim, num_steps=num_steps),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((batch, num_chunks * key_dim, heads * value_dim), config.store_dtype),
        jax.ShapeDtypeStruct((batch, padded_len, heads * value_dim), config.store_dtype),
    ]
    if emit_initial_grad:
        out_specs.append(sequence_spec)
        out_shape.append(
            jax.ShapeDtypeStruct(kernel_states_shape(num_states, heads, key_dim, value_dim, resident), jnp.float32)
        )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(batch, heads // m, num_steps),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((m, key_dim, value_dim), jnp.float32)]
        + (sequence_scratch(per_step, m, key_dim, value_dim, leaving=options.emit_initial_grad) if varlen else []),
    )
    kernel = functools.partial(
        state_bwd_kernel,
        config=config,
        options=options,
        heads=m,
        states_per_row=states_per_row,
        packed=varlen,
        resident=resident,
    )
    with jax.named_scope("kda_state_bwd"):
        results = pl.pallas_call(
            kernel,
            grid_spec=grid_spec,
            out_shape=out_shape,
            compiler_params=compiler_params(sequential_time=True, vmem_limit_bytes=KERNEL_VMEM_BUDGET_BYTES),
            cost_estimate=state_bwd_cost(batch, heads, num_chunks, c, key_dim, value_dim, config.mxu_dtype.itemsize),
            interpret=config.interpret_arg,
            name="kda_state_bwd",
        )(first, last, seq, *args)
    dstate, ddelta = results[0], results[1]
    dh0 = from_kernel_states(results[2], resident) if emit_initial_grad else None
    return dstate, ddelta, dh0
