"""Forward inter-chunk state kernel: the delta-rule corrected recurrence across chunks.

Per chunk, with S the state [K, V] before it (float32, carried in VMEM across the sequential
time axis of the grid), Tinv = (I + Akk)^-1 from the intra kernel and G the within-chunk
cumsum of the decay (assembled from its sub-block-local form by `chunk_math.Decays`):
  w = Tinv (beta * k * exp(G))            u = Tinv (beta * v)           (WY quantities)
  delta = u - w S                                                       (v_new)
  S <- exp(G_last) * S + (k * exp(G_last - G))^T delta                  (decay rows of S)
  o = scale (q * exp(G)) S + Aqk delta                                  (the output)
As it passes each chunk it writes o (Aqk from the intra kernel; the forward), or S before the
chunk (h; the backward's recompute, or the forward with `keep_states`), and optionally the final
state of each sequence and the chunks' poison rows. o off the serial chain of S costs the kernel
less than a separate output kernel reading h and delta back (v6e static estimate, B=2 T=4096
H=16: 370k + 184k cycles for state and output, 471k for the state kernel writing o).

A grid step takes m value heads (`BlockSizes.state_heads_per_step`): their chains of dependent
products are independent, so the scheduler interleaves them (one head per step leaves the matrix
unit waiting on each chain's latency). The per-step blocks are chosen so libtpu's static cost
model estimates the kernel: h and delta are stored token-major ([B, NT*K, HV*V], [B, Tp, HV*V]:
a step writes one [rows, m*V] block, like the k/v/g blocks it reads), and beta and tinv, whose
head-major layout is shared with the other kernels, are read as m one-head blocks. Blocks of m
heads of the head-major beta, tinv, h or delta ([m, rows, ...] blocks moving along the sequential
time axis) make libtpu's static profile estimate 0 cycles for the whole kernel once the grid has
two time steps (tinv's from chunk 128 on).

Varlen: scalar-prefetched per-chunk metadata says where sequences start (reset S to that
sequence's initial state) and end (write its final state). With fixed length these are the grid
step's first and last chunks, and block index maps pick the row's initial/final state; packed
sequences start and end at any chunk, and their states move by DMA (`sequence_states`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_core.errors import InvalidArgumentError
from gla_core.kit import KERNEL_VMEM_BUDGET_BYTES, fold_vmap, row_to_column
from gla_kda.pallas import chunk_math as cm
from gla_kda.pallas import poison as nf
from gla_kda.pallas.config import KernelConfig, compiler_params, head_blocks, token_block
from gla_kda.pallas.sequence_states import (
    SequenceStates,
    from_kernel_states,
    initial_states,
    kernel_states_shape,
    resident_states,
    sequence_scratch,
    starts_row,
    state_spec,
    to_kernel_states,
)


@dataclasses.dataclass(frozen=True)
class StateOutputs:
    """Which optional outputs the state kernel produces.

    Attributes:
      has_initial_state: the kernel takes the initial states h0 (raw: non-finite entries read as 0).
      emit_states: h, the state before every chunk (the backward's, or kept for it).
      emit_final_state: the final state of every sequence.
      emit_output: o = scale (q exp(G)) S + Aqk delta of every chunk, from q and Aqk, written as the
        recurrence passes (no separate kernel reads S and delta back), NaN where the recurrence's
        is not finite. Needs `emit_poison`.
      emit_poison: the chunks' poison rows (`gla_kda.pallas.poison`), the initial states'
        non-finite columns included.
    """

    has_initial_state: bool
    emit_states: bool = True
    emit_final_state: bool = False
    emit_output: bool = False
    emit_poison: bool = False

    def __post_init__(self):
        if self.emit_output and not self.emit_poison:
            raise InvalidArgumentError("StateOutputs: emit_output poisons o from the poison rows; it needs emit_poison")


def wy_deltas(decayed_ks, vs, betas, tinvs, states, dtype):
    """(projected = v - k exp(G) S, delta = Tinv beta projected (same as u - w S)), each a list of
    [C, V] float32, of independent chunks (one per head of a grid step) from decayed_k = k exp(G)
    [C, K], v [C, V], beta [C, 1], tinv [C, C] and the state S [K, V] of each.

    Stage by stage: every chunk's first product is issued before any second one. The matrix units
    take products in program order, so a chunk's second product, waiting on its first, would hold
    back the other chunks' products queued behind it (v6e static estimate of kda_state at B=1
    T=2048 H=4, 4 heads per step: 31.7k cycles chunk by chunk, 27.2k stage by stage)."""
    projected = [v - cm.dot(k, state, dtype) for k, v, state in zip(decayed_ks, vs, states, strict=True)]
    deltas = [cm.dot(tinv, beta * p, dtype) for tinv, beta, p in zip(tinvs, betas, projected, strict=True)]
    return projected, deltas


def advance_state(k_to_end, decays: cm.Decays, delta, state, dtype):
    """State after the chunk: exp(G_last) * S + (k exp(G_last - G))^T delta, [K, V] float32, from
    k_to_end = k exp(G_last - G) [C, K]."""
    return row_to_column(jnp.exp(decays.total)) * state + cm.dot(k_to_end, delta, dtype, trans_a=True)


def chunk_output(raw_q, decay, state, aqk, delta, config: KernelConfig):
    """o = scale (q exp(G)) S + Aqk delta [C, V] float32 of one chunk, not yet poisoned, from
    decay = exp(G) [C, K].

    raw_q [C, K] is not cleaned: a non-finite q_t reaches only row t, which the kernel poisons.
    """
    decayed_q = raw_q.astype(cm.F32) * config.scale * decay
    return cm.dot(decayed_q, state, config.mxu_dtype) + cm.dot(aqk, delta, config.mxu_dtype)


def state_kernel(
    first_ref,
    last_ref,
    seq_ref,
    *refs,
    config: KernelConfig,
    outputs: StateOutputs,
    heads: int,
    states_per_row: int,
    packed: bool,
    resident: bool = False,
):
    """Blocks of n consecutive chunks and m = `heads` value heads (head i of the step at lanes
    i*K.. / i*V..): k [n*C, m*K]; v [n*C, m*V] (input dtype); g [n*C, m*K] raw per-step log
    decays (cleaned and cumsummed here, `chunk_math.Decays.of_steps`); m refs beta [n, 1, C] and
    m refs tinv [n*C, C]; with `emit_output` q [n*C, m*K] (raw) and m refs aqk [n*C, C]; h0
    [m, K, V] raw, or with `packed` the row's per-sequence states (`sequence_states.state_spec`; in
    VMEM when `resident`).

    Outputs: h [n*K, m*V] (the state before each chunk), o [n*C, m*V], ht [m, K, V] (`packed`:
    per sequence, as h0), poison rows [n*8, m*V] (`gla_kda.pallas.poison`; non-finite k, v, g,
    beta and h0 are read as 0, and found by `poison_step` in the steps that have any); scratch
    states [m, K, V] float32, with poison rows the columns poisoned so far [m, 1, V] float32 (1:
    poisoned), and with `packed` `sequence_scratch`. Without `packed` (one sequence
    per batch row) only the step's first chunk may start its sequence and only its last may end it.
    """
    refs = list(refs)
    k_ref, v_ref, g_ref = refs[:3]
    beta_refs = refs[3 : 3 + heads]
    tinv_refs = refs[3 + heads : 3 + 2 * heads]
    rest = refs[3 + 2 * heads :]
    q_ref, aqk_refs = None, None
    if outputs.emit_output:
        q_ref, aqk_refs = rest[0], rest[1 : 1 + heads]
        rest = rest[1 + heads :]
    h0_ref = rest.pop(0) if outputs.has_initial_state else None
    h_ref = rest.pop(0) if outputs.emit_states else None
    o_ref = rest.pop(0) if outputs.emit_output else None
    ht_ref = rest.pop(0) if outputs.emit_final_state else None
    poison_ref = rest.pop(0) if outputs.emit_poison else None
    state_ref = rest.pop(0)
    poisoned_ref = rest.pop(0) if outputs.emit_poison else None
    per_step = beta_refs[0].shape[0]
    c, key_dim = config.blocks.chunk_size, state_ref.shape[1]
    value_dim = state_ref.shape[2]
    sb = cm.SubBlocks(c, config.blocks.sub_chunk)
    t = pl.program_id(2)
    sequences = None
    if packed:
        sequences = SequenceStates(
            first_ref, last_ref, seq_ref, h0_ref, ht_ref, tuple(rest), t * per_step, states_per_row, resident
        )
        sequences.load()

    @pl.when(starts_row(t, first_ref, per_step, packed))
    def _reset():
        initial_states(None if packed else h0_ref, state_ref, poisoned_ref)

    poisoned_at_start = None if poisoned_ref is None else [poisoned_ref[i] for i in range(heads)]

    def walk(step_flags: nf.StepFlags | None = None):
        """Runs the step's chunks from the carried states, writing h, o and (C) poison rows; returns
        the states [K, V] and poisoned columns [1, V] (one per head) after the step. Without
        `step_flags`, non-finite entries of k, v, g and packed sequences' entering states read as 0;
        with them, those are taken as they are (g raised to its floor) and folded into the flags:
        the same for the steps the flags find finite."""
        clean = step_flags is None
        states = [state_ref[i] for i in range(heads)]
        # Poison flags [1, V] (1: poisoned) as sequences restart; the chunks' own poison comes after.
        poisoned = poisoned_at_start
        for n in range(per_step):
            rows = pl.ds(n * c, c)
            if sequences is not None and clean:
                states, poisoned = sequences.restart_finite(n, states, poisoned)
            elif sequences is not None:  # entering states as they are, into the flags
                states = sequences.restart(n, states)
                for entering in sequences.entering_started(n):
                    step_flags.add_values(entering)
            # The heads' chains of dependent products go stage by stage (`wy_deltas`): the deltas, the
            # states after the chunk, then the outputs, which no later product waits on.
            ks, vs, betas, decays, decay = [], [], [], [], []
            for i in range(heads):
                keys, values = pl.ds(i * key_dim, key_dim), pl.ds(i * value_dim, value_dim)
                if h_ref is not None:
                    h_ref[pl.ds(n * key_dim, key_dim), values] = states[i].astype(h_ref.dtype)
                raw_k, raw_v, raw_beta = k_ref[rows, keys], v_ref[rows, values], beta_refs[i][n]
                raw_g = g_ref[rows, keys]
                decays.append(cm.Decays.of_steps(raw_g, sb, config.compensated_decays, clean=clean))
                decay.append(jnp.exp(decays[i].cum))
                ks.append(cm.input_f32(raw_k, clean))
                vs.append(cm.input_f32(raw_v, clean))
                betas.append(row_to_column(cm.finite(raw_beta)))
                if step_flags is not None:
                    step_flags.add_inputs(raw_k, raw_g, raw_beta, raw_v, None if q_ref is None else q_ref[rows, keys])
                    step_flags.add_poisoned(poisoned[i])
                if poison_ref is not None:
                    nf.write_chunk_row(poison_ref, n, values, jnp.full((1, value_dim), float(c), jnp.float32))
            tinvs = [tinv_refs[i][rows, :] for i in range(heads)]
            decayed = [k * d for k, d in zip(ks, decay, strict=True)]
            _, deltas = wy_deltas(decayed, vs, betas, tinvs, states, config.mxu_dtype)
            before = list(states)
            for i in range(heads):
                k_to_end = ks[i] * jnp.exp(decays[i].to_end)
                states[i] = advance_state(k_to_end, decays[i], deltas[i], states[i], config.mxu_dtype)
            if o_ref is not None:
                for i in range(heads):
                    keys, values = pl.ds(i * key_dim, key_dim), pl.ds(i * value_dim, value_dim)
                    o = chunk_output(q_ref[rows, keys], decay[i], before[i], aqk_refs[i][rows, :], deltas[i], config)
                    o_ref[rows, values] = o.astype(o_ref.dtype)
            if sequences is not None:
                sequences.keep(n, states)
        return states, poisoned

    def carry(states, poisoned):
        for i in range(heads):
            state_ref[i] = states[i]
            if poisoned is not None:
                poisoned_ref[i] = poisoned[i]

    if poisoned_ref is None:
        carry(*walk())
    else:
        # The step on its inputs as they are; where it read or carried anything non-finite, again
        # with them cleaned, then its poison (libtpu's static estimate charges only the first walk).
        step_flags = nf.StepFlags()
        states, poisoned = walk(step_flags)
        found = step_flags.any()

        @pl.when(jnp.logical_not(found))
        def _finite():
            carry(states, poisoned)  # no chunk poisoned a column: only restarts changed them

        @pl.when(found)
        def _poison():
            carry(walk()[0], None)
            flags = poison_step(
                k_ref, g_ref, v_ref, beta_refs, q_ref, o_ref, poison_ref, poisoned_at_start, sequences, t
            )
            for i in range(heads):
                poisoned_ref[i] = flags[i]

    if sequences is not None:
        sequences.store()
    if ht_ref is not None and not packed:

        @pl.when(last_ref[t * per_step + per_step - 1] == 1)
        def _final():
            for i in range(heads):
                ht_ref[i] = state_ref[i]


def poison_step(k_ref, g_ref, v_ref, beta_refs, q_ref, o_ref, poison_ref, flags, sequences, t):
    """The poison of grid step t of `state_kernel` (blocks as there), after its o is written: each
    chunk's poison rows, from the raw inputs and the poisoned columns `flags` [1, V] (one per head)
    at the step's start, restarted where packed `sequences` (or None) start; o (q_ref and o_ref, or
    both None) poisoned in place. Returns the poisoned columns after the step."""
    heads, per_step = len(beta_refs), beta_refs[0].shape[0]
    key_dim, value_dim = k_ref.shape[1] // heads, v_ref.shape[1] // heads
    c = k_ref.shape[0] // per_step
    flags = list(flags)
    for n in range(per_step):
        rows = pl.ds(n * c, c)
        if sequences is not None:
            flags = sequences.restart_flags(n, flags)
        for i in range(heads):
            keys, values = pl.ds(i * key_dim, key_dim), pl.ds(i * value_dim, value_dim)
            row = nf.chunk_poison(k_ref[rows, keys], g_ref[rows, keys], beta_refs[i][n], v_ref[rows, values], flags[i])
            nf.write_chunk_row(poison_ref, n, values, row)
            flags[i] = jnp.where(row < c, 1.0, 0.0)
            if o_ref is not None:
                o = nf.poison(o_ref[rows, values].astype(cm.F32), row, q_ref[rows, keys])
                o_ref[rows, values] = o.astype(o_ref.dtype)
    return flags


def heads_per_step(value_heads: int, group: int, most: int) -> int:
    """Value heads per grid step of a kernel that takes consecutive value heads (the state
    recurrences, the per-chunk gradient): the largest divisor of `value_heads` not above `most`,
    or 1 when value heads share q/k heads (`group` > 1: the k block of a step is then not one
    slab of consecutive heads)."""
    if group > 1:
        return 1
    return max(m for m in range(1, min(most, value_heads) + 1) if value_heads % m == 0)


def state_cost(batch, heads, num_chunks, c, k, v, itemsize, outputs: StateOutputs):
    steps = batch * heads * num_chunks
    flops = steps * (2 * c * k * v * 3 + 2 * c * c * v + k * k)
    transcendentals = steps * (2 * c * k + k)
    bytes_accessed = steps * ((c * k + c * v) * itemsize + c * k * 4 + c * 4 + c * c * itemsize)
    if outputs.emit_states:
        bytes_accessed += steps * k * v * itemsize
    if outputs.emit_output:
        flops += steps * (2 * c * k * v + 2 * c * c * v)
        bytes_accessed += steps * (c * k + c * c + c * v) * itemsize
    return pl.CostEstimate(flops=flops, transcendentals=transcendentals, bytes_accessed=bytes_accessed)


def launch_state(
    k,
    v,
    g,
    beta,
    tinv,
    h0,
    meta,
    config: KernelConfig,
    outputs: StateOutputs,
    states_per_row: int,
    varlen: bool,
    q=None,
    aqk=None,
):
    """Runs the recurrence over every chunk.

    Args:
      k: [B, Tp, H*K]; v: [B, Tp, HV*V] (input dtype, token-major, `layout.to_tokens`; K and V
      multiples of 128); g: [B, Tp, HV*K] float32 raw per-step log decays;
      beta: [B, HV, NT, 1, C] float32 (non-finite entries read as 0); tinv: [B, HV, Tp, C] (`launch_intra`);
      h0: [N, HV, K, V] float32 or None (non-finite entries read as 0; their columns poisoned);
      meta: `ChunkMeta` (first, last, seq int32 [NT]).
      states_per_row: N / B (1, or the number of packed sequences of the one varlen row).
      varlen: sequences may start and end at any chunk (`PipelineConfig.varlen`): their states
      move by DMA (`sequence_states`).
      q: [B, Tp, H*K] (token-major) and aqk: [B, HV, Tp, C] (`launch_intra`), for `emit_output`.
    Returns:
      (h [B, NT*K, HV*V] (rows n*K.. hold the state before chunk n; lanes j*V.. value head j) or
      None, o [B, Tp, HV*V] in v's dtype (token-major) or None, ht [N, HV, K, V] float32 or None,
      poison rows [B, NT*8, HV*V] float32 or None: `poison`).
      Under `jax.vmap` the mapped axis folds into B and N (`gla_core.pallas_transforms.fold_vmap`).
    """
    if outputs.emit_output != (q is not None and aqk is not None):
        raise InvalidArgumentError("launch_state: q and aqk are given exactly when StateOutputs.emit_output is set")
    launch = functools.partial(
        _launch_state, config=config, outputs=outputs, states_per_row=states_per_row, varlen=varlen
    )
    args = (k, v, g, beta, tinv, h0, q, aqk, meta.first, meta.last, meta.seq)
    return fold_vmap(launch, args, in_axes=(0,) * 8 + (None,) * 3, out_axes=0)


def _launch_state(k, v, g, beta, tinv, h0, q, aqk, first, last, seq, *, config, outputs, states_per_row, varlen):
    batch, heads = beta.shape[:2]
    padded_len, key_dim, value_dim = g.shape[1], g.shape[2] // heads, v.shape[2] // heads
    c = config.blocks.chunk_size
    num_chunks = padded_len // c
    num_states = batch * states_per_row
    per_step = config.blocks.per_step(num_chunks)
    rows = per_step * c
    m = heads_per_step(heads, config.group, config.blocks.state_heads_per_step)
    sequence_spec = state_spec(varlen, m, key_dim, value_dim, states_per_row)
    resident = resident_states(varlen, states_per_row, m, key_dim, value_dim)
    by_head = head_blocks(m, rows, c)
    in_specs = [
        token_block(rows, m * key_dim, config.group),
        token_block(rows, m * value_dim),
        token_block(rows, m * key_dim),
        *head_blocks(m, per_step, 1, c),
        *by_head,
    ]
    args = [k, v, g, *(beta,) * m, *(tinv,) * m]
    if outputs.emit_output:
        in_specs += [token_block(rows, m * key_dim, config.group), *by_head]
        args += [q, *(aqk,) * m]
    if outputs.has_initial_state:
        in_specs.append(sequence_spec)
        args.append(to_kernel_states(h0, resident))
    out_specs, out_shape = [], []
    if outputs.emit_states:
        out_specs.append(token_block(per_step * key_dim, m * value_dim))
        out_shape.append(jax.ShapeDtypeStruct((batch, num_chunks * key_dim, heads * value_dim), config.store_dtype))
    if outputs.emit_output:
        out_specs.append(token_block(rows, m * value_dim))
        out_shape.append(jax.ShapeDtypeStruct((batch, padded_len, heads * value_dim), v.dtype))
    if outputs.emit_final_state:
        out_specs.append(sequence_spec)
        out_shape.append(
            jax.ShapeDtypeStruct(kernel_states_shape(num_states, heads, key_dim, value_dim, resident), jnp.float32)
        )
    scratch_shapes = [pltpu.VMEM((m, key_dim, value_dim), jnp.float32)]
    if outputs.emit_poison:
        out_specs.append(token_block(per_step * nf.ROWS_PER_CHUNK, m * value_dim))
        out_shape.append(jax.ShapeDtypeStruct((batch, num_chunks * nf.ROWS_PER_CHUNK, heads * value_dim), jnp.float32))
        scratch_shapes.append(pltpu.VMEM((m, 1, value_dim), jnp.float32))
    if varlen:
        scratch_shapes += sequence_scratch(per_step, m, key_dim, value_dim, leaving=outputs.emit_final_state)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(batch, heads // m, num_chunks // per_step),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=scratch_shapes,
    )
    kernel = functools.partial(
        state_kernel,
        config=config,
        outputs=outputs,
        heads=m,
        states_per_row=states_per_row,
        packed=varlen,
        resident=resident,
    )
    cost = state_cost(batch, heads, num_chunks, c, key_dim, value_dim, config.mxu_dtype.itemsize, outputs)
    with jax.named_scope("kda_state"):
        results = pl.pallas_call(
            kernel,
            grid_spec=grid_spec,
            out_shape=out_shape,
            compiler_params=compiler_params(sequential_time=True, vmem_limit_bytes=KERNEL_VMEM_BUDGET_BYTES),
            cost_estimate=cost,
            interpret=config.interpret_arg,
            name="kda_state",
        )(first, last, seq, *args)
    results = list(results)
    h = results.pop(0) if outputs.emit_states else None
    o = results.pop(0) if outputs.emit_output else None
    ht = from_kernel_states(results.pop(0), resident) if outputs.emit_final_state else None
    poison_rows = results.pop(0) if outputs.emit_poison else None
    return h, o, ht, poison_rows
