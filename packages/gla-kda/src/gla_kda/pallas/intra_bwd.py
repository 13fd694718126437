"""Backward per-chunk gradient kernel: dq, dk, dv, dbeta and dg of every chunk.

Inputs per chunk: the state S before it, dS the gradient of the state after it and ddelta (both
from the reverse kernel), dO, and Tinv = (I + Akk)^-1. S is the forward's h (`keep_states`), or,
by default, recomputed here: the kernel walks time in order and advances S with each chunk's
delta, which the gradient forms anyway. That replaces a second run of the state kernel and the
round trip of h through HBM (v6e static estimate, training step at B=2 T=4096 H=16: 1,547k
cycles here plus 354k for the state kernel's recompute, 1,828k for this kernel alone; temp
memory 289 -> 225 MiB). Otherwise the chunks are independent (a parallel grid).
With y = beta (v - k exp(G) S) the forward is delta = Tinv y, o = scale q exp(G) S + Aqk delta,
S_next = exp(G_last) S + (k exp(G_last - G))^T delta, so (q below is scale * q):
  dAqk = tril(dO delta^T)            dTinv = ddelta y^T        dy = Tinv^T ddelta
  dAkk = -strict_tril(Tinv^T dTinv Tinv^T) = -strict_tril(dy delta^T)
  (Akk is strictly lower: no diagonal gradient; dTinv has rank V, so Tinv^T ddelta y^T Tinv^T
  is the product of dy and delta = Tinv y, both already at hand)
  and the gated products Aqk, Akk = beta (k k^T decayed) are differentiated by `chunk_math`.
dg is the gradient with respect to the per-step log decays g themselves: every term is summed
over exactly the steps its exponent spans (`Decays.gate_grad`, `gated_grads.GatedGrads`). The gradient
with respect to the cumsum G, reverse-cumsummed into dg, would hold the row and column terms
of every intra-chunk pair that does not span a step, which cancel exactly: for strong decays
those terms are ~35x dg, and their rounding swamped dg (and dA_log, which sums dg * gate).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_core.kit import KERNEL_VMEM_BUDGET_BYTES, column_to_row, fold_vmap, row_to_column
from gla_kda.pallas import chunk_math as cm
from gla_kda.pallas import poison as nf
from gla_kda.pallas.config import KernelConfig, compiler_params, head_block, head_blocks, token_block
from gla_kda.pallas.gated_grads import GatedGrads, diagonals_in_range, gated_grads
from gla_kda.pallas.sequence_states import (
    SequenceStates,
    initial_states,
    resident_states,
    sequence_scratch,
    starts_row,
    state_spec,
    to_kernel_states,
)
from gla_kda.pallas.state import advance_state, heads_per_step, wy_deltas


def intra_bwd_kernel(
    first_ref,
    last_ref,
    seq_ref,
    *refs,
    config: KernelConfig,
    heads: int,
    carry_states: bool,
    has_initial_state: bool,
    states_per_row: int,
    packed: bool,
    resident: bool = False,
):
    """Blocks of n chunks of m = `heads` consecutive value heads (head i's lanes i*K.. or i*V..): q, k
    [n*C, m*K] (input dtype, non-finite entries read as 0); v [n*C, m*V] (non-finite entries read
    as 0); g [n*C, m*K] raw per-step log decays (cleaned and cumsummed here,
    `chunk_math.Decays.of_steps`); per head, beta [n, 1, C] (non-finite entries read as 0) and tinv
    [n*C, C]; the states: h [n*K, m*V] (the state before each chunk), or with `carry_states` h0
    [m, K, V] raw (if `has_initial_state`; with `packed` the row's per-sequence states,
    `sequence_states.state_spec`, in VMEM when `resident`);
    dstate [n*K, m*V]; ddelta, do [n*C, m*V] (do poisoned here as the forward poisoned o, from its
    poison rows [n*8, m*V]: `gla_kda.pallas.poison`).

    Outputs: dq, dk [n*C, m*K] (per value head, dq already multiplied by scale) and dv [n*C, m*V],
    each in its ref's dtype; dg [n*C, m*K] float32 with respect to the raw log decays (through their
    cleaning, `chunk_math.clean_log_decay_grad`); per head, dbeta [n, 1, C] float32.

    With `carry_states` the kernel runs the forward recurrence itself (the grid's time axis is
    sequential): the state of head i before chunk n is carried in the scratch [m, K, V] float32 and
    advanced with the chunk's delta, which the gradient forms anyway (`state.advance_state`), so the
    states need neither a kernel of their own nor a trip through HBM; the m heads' chains of
    dependent products interleave. Scratch [n*K, m*V] float32 keeps the step's states for the
    recomputed exact step, and with `packed` `sequence_scratch`. Otherwise the chunks are
    independent.
    """
    refs = list(refs)
    q_ref, k_ref, v_ref, g_ref = refs[:4]
    beta_refs, tinv_refs = refs[4 : 4 + heads], refs[4 + heads : 4 + 2 * heads]
    rest = refs[4 + 2 * heads :]
    h_ref = h0_ref = None
    if not carry_states:
        h_ref = rest.pop(0)
    elif has_initial_state:
        h0_ref = rest.pop(0)
    dstate_ref, ddelta_ref, do_ref, poison_ref = rest[:4]
    dq_ref, dk_ref, dv_ref, dg_ref = rest[4:8]
    dbeta_refs = rest[8 : 8 + heads]
    scratch = rest[8 + heads :]
    c = config.blocks.chunk_size
    key_dim, value_dim = q_ref.shape[-1] // heads, v_ref.shape[-1] // heads
    per_step = beta_refs[0].shape[0]
    carries, sequences, t = None, None, pl.program_id(2)
    if carry_states:
        state_ref, h_ref = scratch[:2]
        if packed:
            sequences = SequenceStates(
                first_ref,
                last_ref,
                seq_ref,
                h0_ref,
                None,
                tuple(scratch[2:]),
                t * per_step,
                states_per_row,
                resident,
            )
            sequences.load()

        @pl.when(starts_row(t, first_ref, per_step, packed))
        def _reset():
            initial_states(None if packed else h0_ref, state_ref)

        carries = [state_ref[i] for i in range(heads)]

    def write(anchor_range, carries, step_flags: nf.StepFlags | None = None):
        """Writes every output, the diagonal sub-blocks anchored within `anchor_range` (None: exact);
        returns the chunks' `Decays` and the carried states after the step. With `carries`, each
        head's carried state [K, V] before the step's first chunk: the states are advanced from
        them (and kept in h_ref); without, read from h_ref. Without `step_flags`, non-finite q, k, v
        and g entries read as 0 and dO is poisoned as the forward poisoned o; with them, the inputs
        are taken as they are (g raised to its floor), dO is not poisoned and q is folded into the
        flags: the same for the steps the flags find finite and unpoisoned."""
        clean = step_flags is None
        products = {}
        for n in range(per_step):
            rows, state_rows = pl.ds(n * c, c), pl.ds(n * key_dim, key_dim)
            if carries is not None and sequences is not None:
                carries = sequences.restart(n, carries, clean=clean)
            # Stage by stage over the heads (`state.wy_deltas`): their deltas, the states after the
            # chunk (the next chunk waits on them), then the products of the gradient.
            states, ks, vs, gates, betas, tinvs = [], [], [], [], [], []
            for i in range(heads):
                keys, values = pl.ds(i * key_dim, key_dim), pl.ds(i * value_dim, value_dim)
                if carries is not None:
                    h_ref[state_rows, values] = carries[i]
                    states.append(carries[i])
                else:
                    states.append(h_ref[state_rows, values].astype(cm.F32))
                ks.append(cm.input_f32(k_ref[rows, keys], clean))
                vs.append(cm.input_f32(v_ref[rows, values], clean))
                gates.append(g_ref[rows, keys])
                betas.append(row_to_column(cm.finite(beta_refs[i][n])))
                tinvs.append(tinv_refs[i][rows, :])
            forwards = chunk_forwards(ks, vs, gates, betas, tinvs, states, config, clean)
            for i, (k, forward) in enumerate(zip(ks, forwards, strict=True)):
                if carries is not None:
                    carries[i] = advance_state(
                        k * forward.to_end, forward.decays, forward.delta, carries[i], config.mxu_dtype
                    )
            for i, forward in enumerate(forwards):
                keys, values = pl.ds(i * key_dim, key_dim), pl.ds(i * value_dim, value_dim)
                raw_q = q_ref[rows, keys]
                do = do_ref[rows, values].astype(cm.F32)
                if clean:
                    do = nf.poison_chunk(do, poison_ref, n, raw_q, values)
                else:
                    step_flags.add_values(raw_q)
                dstate = dstate_ref[state_rows, values].astype(cm.F32)
                ddelta = ddelta_ref[rows, values].astype(cm.F32)
                q = cm.input_f32(raw_q, clean) * config.scale
                products[n, i] = chunk_products(
                    q, ks[i], betas[i], tinvs[i], states[i], dstate, ddelta, do, forward, config
                )
        # Then the gated products' gradients of every chunk, then the rest: stage by stage, the
        # chunks' chains interleave (`state.wy_deltas`).
        gated = {key: chunk_gated_grads(chunk, config, anchor_range) for key, chunk in products.items()}
        for (n, i), chunk in products.items():
            rows = pl.ds(n * c, c)
            keys, values = pl.ds(i * key_dim, key_dim), pl.ds(i * value_dim, value_dim)
            dq, dk, dv, dbeta, dg = chunk_grads(chunk, gated[n, i], config)
            dq_ref[rows, keys] = (dq * config.scale).astype(dq_ref.dtype)
            dk_ref[rows, keys] = dk.astype(dk_ref.dtype)
            dv_ref[rows, values] = dv.astype(dv_ref.dtype)
            dbeta_refs[i][n] = column_to_row(dbeta)
            dg_ref[rows, keys] = cm.clean_log_decay_grad(g_ref[rows, keys], dg)
        return [chunk.decays for chunk in products.values()], carries

    def carry(states):
        if carry_states:
            for i in range(heads):
                state_ref[i] = states[i]

    # The step on its inputs as they are, with the diagonal sub-blocks anchored. Where the forward
    # poisoned a chunk of it, q is not finite or a chunk is out of the anchor range, the step again
    # with the inputs cleaned and the diagonal sub-blocks exact, from the states before its first
    # chunk (kept in h_ref). libtpu's static estimate charges only the first pass; with two
    # branches, one for non-finite steps and one for steps out of range, it charged part of them
    # too (v6e, B=1 T=2048 H=4 training: 107.5k cycles against 76.5k with one).
    anchor_range = config.anchor
    step_flags = nf.StepFlags()
    step_flags.add_mask(poison_ref[...] < c)
    decays, final = write(anchor_range, carries, step_flags)
    carry(final)
    again = step_flags.any()
    if anchor_range is not None:
        in_range = functools.reduce(jnp.logical_and, [diagonals_in_range(d, anchor_range) for d in decays])
        again = again | jnp.logical_not(in_range)

    @pl.when(again)
    def _again():
        starts = None
        if carry_states:
            starts = [h_ref[pl.ds(0, key_dim), pl.ds(i * value_dim, value_dim)] for i in range(heads)]
        carry(write(None, starts)[1])


@dataclasses.dataclass(frozen=True)
class ChunkProducts:
    """One chunk's inputs and the matrix products of its gradient before the gated scores' (all float32).

    q (scaled), k, decay = exp(G), to_end = exp(G_last - G), d_q_decayed, d_k_decayed, d_k_to_end
    [C, K]; projected = v - k exp(G) S, delta = Tinv beta projected, dy [C, V]; beta [C, 1];
    state, dstate [K, V]; d_akk,
    d_aqk [C, C] the cotangents of Akk and Aqk; decays the chunk's `chunk_math.Decays`.
    """

    q: jax.Array
    k: jax.Array
    beta: jax.Array
    state: jax.Array
    dstate: jax.Array
    decays: cm.Decays
    decay: jax.Array
    to_end: jax.Array
    projected: jax.Array
    delta: jax.Array
    dy: jax.Array
    d_q_decayed: jax.Array
    d_k_decayed: jax.Array
    d_k_to_end: jax.Array
    d_akk: jax.Array
    d_aqk: jax.Array


@dataclasses.dataclass(frozen=True)
class ChunkForward:
    """What the forward formed of one chunk (float32): decays, decay = exp(G), to_end =
    exp(G_last - G) [C, K], projected = v - k exp(G) S and delta = Tinv beta projected [C, V]."""

    decays: cm.Decays
    decay: jax.Array
    to_end: jax.Array
    projected: jax.Array
    delta: jax.Array


def chunk_forwards(ks, vs, gates, betas, tinvs, states, config: KernelConfig, clean: bool = True) -> list[ChunkForward]:
    """`ChunkForward` of independent chunks (one per head of a grid step; `state.wy_deltas`): per
    chunk k [C, K]; v [C, V]; g [C, K] the raw per-step log decays (`clean`: as
    `chunk_math.Decays.of_steps` takes them); beta [C, 1]; tinv [C, C] (`config.store_dtype`);
    state [K, V]."""
    sub_blocks = cm.SubBlocks(config.blocks.chunk_size, config.blocks.grad_sub_chunk)
    decays = [cm.Decays.of_steps(g, sub_blocks, clean=clean) for g in gates]
    decay = [jnp.exp(d.cum) for d in decays]
    decayed = [k * d for k, d in zip(ks, decay, strict=True)]
    projected, deltas = wy_deltas(decayed, vs, betas, tinvs, states, config.mxu_dtype)
    return [
        ChunkForward(d, e, jnp.exp(d.to_end), p, delta)
        for d, e, p, delta in zip(decays, decay, projected, deltas, strict=True)
    ]


def chunk_products(q, k, beta, tinv, state, dstate, ddelta, do, forward: ChunkForward, config: KernelConfig):
    """`ChunkProducts` of one chunk.

    q (scaled), k [C, K]; ddelta, do [C, V]; beta [C, 1]; tinv [C, C] (`config.store_dtype`);
    state, dstate [K, V]; the others float32; forward: the chunk's `chunk_forwards`.
    """
    dtype, c = config.mxu_dtype, config.blocks.chunk_size
    decays, decay, projected, delta = forward.decays, forward.decay, forward.projected, forward.delta
    dy = cm.dot(tinv, ddelta, dtype, trans_a=True)
    # dO and dy against the state and delta: one product, [2C, V] x [K + C, V]^T.
    key_dim = state.shape[0]
    against = cm.dot(jnp.concatenate([do, dy], axis=0), jnp.concatenate([state, delta], axis=0), dtype, trans_b=True)
    return ChunkProducts(
        q=q,
        k=k,
        beta=beta,
        state=state,
        dstate=dstate,
        decays=decays,
        decay=decay,
        to_end=forward.to_end,
        projected=projected,
        delta=delta,
        dy=dy,
        d_q_decayed=against[:c, :key_dim],
        d_k_decayed=-beta * against[c:, :key_dim],
        d_k_to_end=cm.dot(delta, dstate, dtype, trans_b=True),
        d_akk=jnp.where(cm.lower_mask(c, strict=True), -against[c:, key_dim:], 0.0),
        d_aqk=jnp.where(cm.lower_mask(c, strict=False), against[:c, key_dim:], 0.0),
    )


def chunk_gated_grads(p: ChunkProducts, config: KernelConfig, anchor_range: float | None) -> GatedGrads:
    """The gradients of one chunk's gated products (`gated_grads.gated_grads`). anchor_range: of the
    diagonal sub-blocks' gated products, or None for the exact loop."""
    # Akk = beta * P[k] (strict), Aqk = P[q] (incl. the diagonal): W = d_akk with a = beta k, and d_aqk with a = q.
    pairs = [(p.d_akk, p.beta * p.k), (p.d_aqk, p.q)]
    return gated_grads(pairs, p.k, p.decays, config.mxu_dtype, config.unroll, anchor_range)


def chunk_grads(p: ChunkProducts, grads: GatedGrads, config: KernelConfig):
    """(dq before the scale, dk, dv [C, V], dbeta [C, 1], dg) of one chunk, float32 ([C, K] unless
    stated), from its products and `chunk_gated_grads`."""
    dtype, q, k, beta, decays = config.mxu_dtype, p.q, p.k, p.beta, p.decays
    dv = beta * p.dy
    dbeta = jnp.sum(p.dy * p.projected, axis=1, keepdims=True)
    (rows_kk, rows_qk), (cols_kk, cols_qk) = grads.rows, grads.cols
    dbeta = dbeta + jnp.sum(k * rows_kk, axis=1, keepdims=True)

    dq = p.d_q_decayed * p.decay + rows_qk
    dk = p.d_k_decayed * p.decay + p.d_k_to_end * p.to_end + beta * rows_kk + cols_kk + cols_qk
    # q exp(G), k exp(G) depend on the decays up to their step, k exp(G_last - G) on those after it,
    # and the carried state on all of them.
    state_term = column_to_row(jnp.sum(p.state * p.dstate, axis=1, keepdims=True)) * jnp.exp(decays.total)
    dg = (
        decays.gate_grad(
            after=p.d_q_decayed * (q * p.decay) + p.d_k_decayed * (k * p.decay),
            before=p.d_k_to_end * (k * p.to_end),
            after_block=grads.after_block,
            before_block=grads.before_block,
            dtype=dtype,
        )
        + grads.direct
        + state_term
    )
    return dq, dk, dv, dbeta, dg


def intra_bwd_cost(batch, heads, num_chunks, c, k, v, s, itemsize):
    steps = batch * heads * num_chunks
    flops = steps * (2 * c * k * v * 4 + 2 * c * c * v * 4 + 2 * 2 * c * c * c + 8 * 2 * c * c * k + 8 * c * s * k)
    transcendentals = steps * (2 * s + 2 * c // s + 2) * c * k
    bytes_accessed = steps * (
        2 * c * k * itemsize
        + c * v * itemsize * 3
        + c * k * 4
        + c * 4
        + c * c * 4
        + 2 * k * v * itemsize
        + (3 * c * k + c * v + c) * 4
    )
    return pl.CostEstimate(flops=flops, transcendentals=transcendentals, bytes_accessed=bytes_accessed)


def launch_intra_bwd(
    q,
    k,
    v,
    g,
    beta,
    tinv,
    h,
    dstate,
    ddelta,
    do,
    poison_rows,
    config: KernelConfig,
    meta,
    h0,
    has_initial_state: bool,
    states_per_row: int,
    varlen: bool,
):
    """Per-chunk gradients, read and written in the forward's token-major layout (no transposed copies).

    Args:
      q, k: [B, Tp, H*K]; v: [B, Tp, HV*V] (token-major, `layout.to_tokens`; non-finite entries read as 0);
      g: [B, Tp, HV*K] float32 raw per-step log decays (cleaned as the forward kernels clean them);
      beta: [B, HV, NT, 1, C]; tinv: [B, HV, Tp, C]; h: [B, NT*K, HV*V] (`state.launch_state`: rows
      n*K.. the state before chunk n, lanes j*V.. value head j), or None: the kernel then runs the
      recurrence itself from h0 [N, HV, K, V] float32 (raw; None for zeros), its time axis
      sequential; meta: `ChunkMeta` (where sequences start; `states_per_row`, `varlen` as
      `state.launch_state`'s);
      dstate: [B, NT*K, HV*V] (the same layout, the gradient of the state after chunk n) and
      ddelta, do: [B, Tp, HV*V] (token-major), both from `state_bwd.launch_state_bwd`;
      poison_rows: [B, NT*8, HV*V] float32, the forward's (`gla_kda.pallas.poison`).
    Returns: dq, dk [B, Tp, HV*K] (per value head, token-major; in q's dtype, or float32 when value
      heads share q/k heads and the caller sums them); dv [B, Tp, HV*V] in v's dtype; dg [B, Tp, HV*K]
      float32 with respect to the raw g; dbeta [B, HV, NT, 1, C] float32.
      Under `jax.vmap` the mapped axis folds into B (`gla_core.pallas_transforms.fold_vmap`).
    """
    carry_states = h is None
    launch = functools.partial(
        _launch_intra_bwd,
        config=config,
        carry_states=carry_states,
        has_initial_state=has_initial_state,
        states_per_row=states_per_row,
        varlen=varlen,
    )
    args = (q, k, v, g, beta, tinv, h, h0, dstate, ddelta, do, poison_rows, meta.first, meta.last, meta.seq)
    return fold_vmap(launch, args, in_axes=(0,) * 12 + (None,) * 3, out_axes=0)


def _launch_intra_bwd(
    q,
    k,
    v,
    g,
    beta,
    tinv,
    h,
    h0,
    dstate,
    ddelta,
    do,
    poison_rows,
    first,
    last,
    seq,
    *,
    config: KernelConfig,
    carry_states: bool,
    has_initial_state: bool,
    states_per_row: int,
    varlen: bool,
):
    batch, heads = beta.shape[:2]
    padded_len, key_dim = g.shape[1], g.shape[2] // heads
    value_dim = v.shape[-1] // heads
    c = config.blocks.chunk_size
    num_chunks = padded_len // c
    per_step = config.blocks.per_step(num_chunks, config.blocks.grad_chunks_per_step)
    rows = per_step * c
    m = heads_per_step(heads, config.group, config.blocks.grad_heads_per_step)
    qk_spec = token_block(rows, m * key_dim, config.group)
    key_spec = token_block(rows, m * key_dim)
    value_spec = token_block(rows, m * value_dim)
    states_spec = token_block(per_step * key_dim, m * value_dim)
    in_specs = [qk_spec, qk_spec, value_spec, key_spec]
    in_specs += head_blocks(m, per_step, 1, c) + head_blocks(m, rows, c)
    args = [q, k, v, g, *(beta,) * m, *(tinv,) * m]
    scratch_shapes = []
    resident = resident_states(varlen, states_per_row, m, key_dim, value_dim)
    if not carry_states:
        in_specs.append(states_spec)
        args.append(h)
    else:
        if has_initial_state:
            in_specs.append(state_spec(varlen, m, key_dim, value_dim, states_per_row))
            args.append(to_kernel_states(h0, resident))
        state = pltpu.VMEM((m, key_dim, value_dim), jnp.float32)  # the carried states
        scratch_shapes = [state, pltpu.VMEM((per_step * key_dim, m * value_dim), jnp.float32)]
        if varlen:
            scratch_shapes += sequence_scratch(per_step, m, key_dim, value_dim, leaving=False)
    in_specs += [states_spec, value_spec, value_spec, token_block(per_step * nf.ROWS_PER_CHUNK, m * value_dim)]
    args += [dstate, ddelta, do, poison_rows]
    f32 = jnp.float32
    qk_grad_dtype = q.dtype if config.group == 1 else f32
    # One dbeta per head of a step, [B, HV/m, NT, 1, C] each: a block of m heads of the head-major
    # dbeta makes libtpu's static profile estimate 0 cycles for the kernel (as `state.py` says of
    # its inputs); the heads are interleaved back in XLA (B*HV*T floats).
    dbeta_spec = head_block(per_step, 1, c)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(batch, heads // m, num_chunks // per_step),
        in_specs=in_specs,
        out_specs=[key_spec, key_spec, value_spec, key_spec] + [dbeta_spec] * m,
        scratch_shapes=scratch_shapes,
    )
    kernel = functools.partial(
        intra_bwd_kernel,
        config=config,
        heads=m,
        carry_states=carry_states,
        has_initial_state=has_initial_state,
        states_per_row=states_per_row,
        packed=varlen,
        resident=resident,
    )
    dbeta_of_heads = jax.ShapeDtypeStruct((batch, heads // m, num_chunks, 1, c), f32)
    with jax.named_scope("kda_intra_bwd"):
        dq, dk, dv, dg, *dbetas = pl.pallas_call(
            kernel,
            grid_spec=grid_spec,
            out_shape=[
                jax.ShapeDtypeStruct(g.shape, qk_grad_dtype),
                jax.ShapeDtypeStruct(g.shape, qk_grad_dtype),
                jax.ShapeDtypeStruct(v.shape, v.dtype),
                jax.ShapeDtypeStruct(g.shape, f32),
                *(dbeta_of_heads,) * m,
            ],
            compiler_params=compiler_params(sequential_time=carry_states, vmem_limit_bytes=KERNEL_VMEM_BUDGET_BYTES),
            cost_estimate=intra_bwd_cost(
                batch, heads, num_chunks, c, key_dim, value_dim, config.blocks.grad_sub_chunk, config.mxu_dtype.itemsize
            ),
            interpret=config.interpret_arg,
            name="kda_intra_bwd",
        )(first, last, seq, *args)
    dbeta = dbetas[0] if m == 1 else jnp.stack(dbetas, axis=2).reshape(beta.shape)
    return dq, dk, dv, dbeta, dg
