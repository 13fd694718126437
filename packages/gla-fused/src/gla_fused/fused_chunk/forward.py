"""`fused_chunk_fwd`: the forward in one kernel, reading and writing the op's own layouts.

Per head and chunk (b_t the sum of the chunk's log decays through step t, L its last step, S
the `[K, V]` state before the chunk):

    o_t = scale * ( e^{b_t} q_t S  +  sum_{s<=t} (q_t . k_s) e^{b_t - b_s} v_s )
    S  <- e^{b_L} S + sum_s e^{b_L - b_s} k_s v_s^T

The grid is (B, T / Tb): batch rows are parallel, time is sequential ("arbitrary"). A grid step
takes all H heads of Tb tokens straight from the `[B, T*H, D]` views of q, k, v and o (see
`gla_core.kit.HeadRows`), the gates as `[H, Tb]` rows, and the initial and final states in the
op's `[B, H, K, V]` layout: no transposed or padded copy of anything in HBM. The states of all
heads stay in VMEM along the time walk.

Packed varlen rows (`geo.num_sequences` N) arrive in the padded per-sequence chunk layout of
`gla_core.kit.varlen` (every chunk belongs to one sequence; sequences start and end at any chunk
of a grid step). The per-chunk metadata (`first`, `last`, `sequence`, `length`, int32 [NT]) is
scalar-prefetched; the per-sequence states `[B*N, H, K, V]` stay in HBM and move by DMA: a chunk
that starts a sequence restarts the carried states of all heads from its initial states (or
zero), one that ends it writes them to its final states (`SequenceEdges`). The padding steps of a
sequence's last chunk hold other tokens of the row (`gla_core.kit.gather_chunks` does not zero
them, which would take XLA a second pass over every array): the kernels zero them with
`jnp.where`, so they carry nothing into any state or gradient.

Every exponent is a segment sum from the compensated chunk cumsums (`gla_core.kit.chunk_cumsum`)
and is <= 0 where it is used; `scale` enters as log(scale) in the exponents of the intra-chunk
decays and as a factor of the inter-chunk ones. Non-finite inputs: a grid step first computes
without masks (the decays are exactly 0 above the diagonal); if the sum of its new states is not
finite (a non-finite k or v, or an earlier one), it recomputes from its initial states (kept by
step parity in a two-slot state scratch) masking the causal scores with `jnp.where` and the
values' non-finite entries, every row from a chunk's first non-finite value on being NaN, as in
the recurrence. A non-finite q_t or gate reaches only rows at or after t without masks.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_core.kit import (
    KERNEL_VMEM_BUDGET_BYTES,
    NN,
    NT,
    HeadRows,
    chunk_cumsum,
    compiler_params,
    cost_estimate,
    dot,
    heads_per_group,
    interpret_params,
)

F32 = jnp.float32
# Masked exponents: exp of it is exactly 0 in float32.
MASKED = -1e30


@dataclasses.dataclass(frozen=True)
class ForwardGeometry:
    """Static sizes of one forward call.

    Attributes:
      num_heads: H.
      chunk: C, tokens per chunk (a power of two).
      block_tokens: Tb, tokens per grid step (a multiple of C that divides T).
      scale: the query scale.
      has_h0, has_ht: an initial state is given; the final state is returned.
      has_states: the state before every chunk is returned (for the backward).
      mxu_dtype: the dtype of the matmul operands (bfloat16 or float32).
      interpret: TPU interpret mode.
      num_sequences: N, the packed sequences of a varlen row (`SequenceEdges`), or None (fixed
        length: one sequence per batch row).
    """

    num_heads: int
    chunk: int
    block_tokens: int
    scale: float
    has_h0: bool
    has_ht: bool
    has_states: bool
    mxu_dtype: jnp.dtype
    interpret: bool
    num_sequences: int | None = None

    @property
    def chunks_per_block(self) -> int:
        return self.block_tokens // self.chunk

    @property
    def varlen(self) -> bool:
        return self.num_sequences is not None


@dataclasses.dataclass(frozen=True)
class SequenceEdges:
    """Packed sequences inside a walk over chunks (`ForwardGeometry.varlen`): the scalar-prefetched
    per-chunk metadata, int32 [NT] (SMEM), `starts_ref` / `ends_ref` in walking order (forwards:
    first / last chunk of a sequence; backwards: last / first), `sequence_ref` the chunk's sequence,
    `length_ref` its real steps (the rest are padding), and the per-sequence states
    `[B*N, H, K, V]` float32 in HBM: `initial_ref` read where a sequence starts (None: zero),
    `final_ref` written where it ends (None: not wanted)."""

    num_sequences: int
    starts_ref: jax.Array
    ends_ref: jax.Array
    sequence_ref: jax.Array
    length_ref: jax.Array
    initial_ref: jax.Array | None
    final_ref: jax.Array | None

    def real_steps(self, chunk, size: int) -> jax.Array:
        """`[C, 1]` bool: the steps of `chunk` (C = `size`) that belong to its sequence, not padding.

        (Zeroing the padding rows of the whole block in place once per chunk, under `pl.when`, costs
        more by libtpu's static estimate, which charges the branch to every chunk: fused_chunk_fwd
        346 k cycles against 305 k masking each head's rows, B=1 T=8192 4 sequences H=16, v6e.)"""
        return jax.lax.broadcasted_iota(jnp.int32, (size, 1), 0) < self.length_ref[chunk]

    @staticmethod
    def masked(real: jax.Array, *rows: jax.Array) -> tuple[jax.Array, ...]:
        """Token rows `[C, D]` with the padding steps (`real` false) zeroed."""
        return tuple(jnp.where(real, x, jnp.zeros((), x.dtype)) for x in rows)

    def _entry(self, states_ref, chunk):
        return states_ref.at[pl.program_id(0) * self.num_sequences + self.sequence_ref[chunk]]

    def restart(self, state_ref, chunk) -> None:
        """Where `chunk` starts a sequence, the states of all heads `state_ref` [H, K, V] (VMEM)
        become its initial states (a DMA from HBM) or zero."""

        @pl.when(self.starts_ref[chunk] == 1)
        def _restart():
            if self.initial_ref is None:
                state_ref[...] = jnp.zeros(state_ref.shape, F32)
            else:
                pltpu.sync_copy(self._entry(self.initial_ref, chunk), state_ref)

    def emit(self, state_ref, chunk) -> None:
        """Where `chunk` ends a sequence, writes `state_ref` [H, K, V] (VMEM) to its final states."""
        if self.final_ref is None:
            return

        @pl.when(self.ends_ref[chunk] == 1)
        def _emit():
            pltpu.sync_copy(state_ref, self._entry(self.final_ref, chunk))


def time_grid_spec(geo: ForwardGeometry, grid, in_specs, out_specs, scratch_shapes):
    """The grid spec of a fused kernel: plain for fixed length; for packed varlen rows the per-chunk
    metadata (first, last, sequence, length) scalar-prefetched, its refs passed to every index map
    after the grid indices (the `(bi, ti)` maps ignore them)."""
    if not geo.varlen:
        return dict(grid=grid, in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch_shapes)

    def with_metadata(spec):
        if spec.index_map is None:  # left in HBM (memory_space ANY)
            return spec
        index_map = spec.index_map
        return pl.BlockSpec(spec.block_shape, lambda bi, ti, *meta: index_map(bi, ti))

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=grid,
        in_specs=[with_metadata(spec) for spec in in_specs],
        out_specs=[with_metadata(spec) for spec in out_specs],
        scratch_shapes=scratch_shapes,
    )
    return dict(grid_spec=grid_spec)


def sequence_state_spec(geo: ForwardGeometry, kdim: int, vdim: int) -> pl.BlockSpec:
    """Initial or final states (or their gradients): the batch row's `[H, K, V]` block of `[B, H, K, V]`,
    or for packed varlen rows the whole `[B*N, H, K, V]` left in HBM for `SequenceEdges`' DMAs."""
    if geo.varlen:
        return pl.BlockSpec(memory_space=pl.ANY)
    return pl.BlockSpec((1, geo.num_heads, kdim, vdim), lambda bi, ti: (bi, 0, 0, 0))


class ChunkDecays:
    """The decays of one head's chunk from its compensated cumulative log decays (rows `[1, C]`).

    `log_scale` is added to the intra-chunk exponents (the output's scale).
    """

    def __init__(self, hi: jax.Array, lo: jax.Array, causal: jax.Array, log_scale: float):
        c = hi.shape[1]
        self.hi, self.lo, self.causal = hi, lo, causal
        rows = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
        self.diagonal = rows == jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
        self.last_step = jax.lax.broadcasted_iota(jnp.int32, (1, c), 1) == c - 1
        hi_s = jnp.broadcast_to(hi, (c, c))  # [t, s] = hi_s
        lo_s = jnp.broadcast_to(lo, (c, c))
        hi_t = hi_s.T
        lo_t = jnp.broadcast_to(lo + log_scale, (c, c)).T
        # b_t - b_s + log(scale) for t >= s, masked above the diagonal
        self.exponents = jnp.where(causal, (hi_t - hi_s) + (lo_t - lo_s), MASKED)

    def intra(self) -> jax.Array:
        """scale * e^{b_t - b_s} for t >= s, else 0: [C, C]."""
        return jnp.exp(self.exponents)

    def from_start(self) -> jax.Array:
        """scale * e^{b_t}: [C, 1] (column 0 of the exponents plus b_0)."""
        return jnp.exp(self.exponents[:, 0:1] + (self.hi[:, 0:1] + self.lo[:, 0:1]))

    def to_end(self) -> jax.Array:
        """e^{b_L - b_s}: [1, C]."""
        return jnp.exp((self.hi[:, -1:] - self.hi) + (self.lo[:, -1:] - self.lo))

    def whole(self) -> jax.Array:
        """e^{b_L}: [1, 1]."""
        return jnp.exp(self.hi[:, -1:] + self.lo[:, -1:])


# Above the counted blocks, scratch and temporaries: Mosaic's own internal scratch.
VMEM_HEADROOM_BYTES = 8 << 20
# The [C, C] float32 temporaries of one head and chunk that a grid step keeps at once (scores, decays
# and their masked forms): at 512 tokens of chunk 256 and 16 heads the forward's scoped allocation is
# 54.2 MiB, 22 MiB of it blocks and scratch, so four per head and chunk.
CHUNK_TEMPORARIES = 4


def sequential_in_time_params(vmem_bytes: int, *, heads: int, chunk: int, chunks: int):
    """Compiler parameters of a fused_chunk kernel: batch rows in parallel, token blocks in order (the
    state is carried in VMEM), and a scoped VMEM limit of `KERNEL_VMEM_BUDGET_BYTES`, or of the counted
    `vmem_bytes` (blocks and scratch), the [C, C] temporaries of `heads` heads and `chunks` chunks of
    C = `chunk` per grid step, and headroom, when that is more."""
    temporaries = CHUNK_TEMPORARIES * heads * chunks * chunk * chunk * 4
    limit = max(vmem_bytes + temporaries + VMEM_HEADROOM_BYTES, KERNEL_VMEM_BUDGET_BYTES)
    return compiler_params("parallel", "arbitrary", vmem_limit_bytes=limit)


def block_bytes(specs, arrays) -> int:
    """Bytes of one block of every array (BlockSpecs and arrays or shape structs, in order); arrays
    left in HBM (no block) take none."""
    pairs = zip(specs, arrays, strict=True)
    return sum(math.prod(spec.block_shape) * jnp.dtype(x.dtype).itemsize for spec, x in pairs if spec.block_shape)


def _chunk_step(q, k, v, state, decays: ChunkDecays, dtype, masked: bool):
    """o [C, V] float32 and the next state [K, V] float32 of one head's chunk.

    Unmasked, the intra-chunk product relies on the decays being exactly 0 above the diagonal,
    which holds unless k or v holds a non-finite value (then the next state is not finite either,
    and the caller recomputes with `masked`).
    """
    scores = dot(q, k, NT, dtype) * decays.intra()
    kt = (k.T.astype(F32) * decays.to_end()).astype(dtype)  # [K, C]
    new_state = state * decays.whole() + dot(kt, v, NN, dtype)
    inter = dot(q, state, NN, dtype) * decays.from_start()
    if not masked:
        return dot(scores, v, NN, dtype) + inter, new_state
    finite = jnp.isfinite(v.astype(F32))
    intra = dot(jnp.where(decays.causal, scores, 0.0), jnp.where(finite, v, jnp.zeros((), v.dtype)), NN, dtype)
    steps = jax.lax.broadcasted_iota(jnp.int32, (v.shape[0], 1), 0)
    bad_steps = jnp.where(jnp.min(finite.astype(jnp.int32), axis=1, keepdims=True) == 0, steps, v.shape[0])
    # The recurrence's state is not finite from the first non-finite value on.
    return jnp.where(steps >= jnp.min(bad_steps), jnp.nan, intra + inter), new_state


def _forward_kernel(*refs, geo: ForwardGeometry):
    meta, refs = (refs[:4], refs[4:]) if geo.varlen else (None, refs)  # first, last, sequence, length [NT]
    q_ref, k_ref, v_ref, gate_ref = refs[:4]  # [1, Tb*H, K], [1, Tb*H, K], [1, Tb*H, V], [1, H, Tb]
    h0_ref = refs[4] if geo.has_h0 else None  # [1, H, K, V] (varlen: [B*N, H, K, V] in HBM)
    o_ref = refs[4 + geo.has_h0]  # [1, Tb*H, V]
    ht_ref = refs[5 + geo.has_h0] if geo.has_ht else None  # [1, H, K, V] (varlen: [B*N, H, K, V] in HBM)
    states_out = refs[5 + geo.has_h0 + geo.has_ht] if geo.has_states else None  # [1, NC, H, K, V]
    state_ref, hi_ref, lo_ref = refs[-3:]  # [2, H, K, V] (by step parity), [H, 1, Tb], [H, 1, Tb] float32
    step = pl.program_id(1)
    c, h_count = geo.chunk, geo.num_heads
    parity = step % 2
    before, after = state_ref.at[parity], state_ref.at[1 - parity]

    edges = SequenceEdges(geo.num_sequences, *meta, h0_ref, ht_ref) if geo.varlen else None

    @pl.when(step == 0)
    def _start():
        state_ref[0] = h0_ref[0] if geo.has_h0 and edges is None else jnp.zeros(state_ref.shape[1:], F32)

    hi, lo = chunk_cumsum(gate_ref[0], c)
    hi_ref[...] = hi[:, None, :]
    lo_ref[...] = lo[:, None, :]
    rows = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    causal = rows >= jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    log_scale = math.log(geo.scale)
    q_rows, k_rows, v_rows, o_rows = (HeadRows(r, h_count, geo.interpret) for r in (q_ref, k_ref, v_ref, o_ref))
    group = q_rows.group

    def walk(masked: bool):
        """All chunks and heads of the block; returns the sum of the new states (finite unless a
        k, v or state is not): summed over sublanes per head, over lanes once."""
        total = jnp.zeros((1, state_ref.shape[-1]), F32)
        for chunk in range(geo.chunks_per_block):
            first = chunk * c
            window = pl.ds(first, c)
            source = before if chunk == 0 else after
            if edges is not None:
                edges.restart(source, step * geo.chunks_per_block + chunk)
                real = edges.real_steps(step * geo.chunks_per_block + chunk, c)
            for head in range(0, h_count, group):
                loaded = zip(
                    q_rows.load(first, c, head), k_rows.load(first, c, head), v_rows.load(first, c, head), strict=True
                )
                outs = []
                for h, (q, k, v) in zip(range(head, head + group), loaded, strict=True):
                    if edges is not None:
                        k, v = edges.masked(real, k, v)  # a padding q only reaches its own (dropped) row
                    decays = ChunkDecays(hi_ref[h, :, window], lo_ref[h, :, window], causal, log_scale)
                    state = source[h]
                    if geo.has_states and not masked:
                        states_out[0, chunk, h] = state
                    o, new_state = _chunk_step(q, k, v, state, decays, geo.mxu_dtype, masked)
                    after[h] = new_state
                    total = total + jnp.sum(new_state, axis=0, keepdims=True)
                    outs.append(o)
                o_rows.store(first, head, tuple(outs))
            if edges is not None:
                edges.emit(after, step * geo.chunks_per_block + chunk)
        return jnp.sum(total)

    # The products are unmasked first; a non-finite k or v (or state) makes the states' sum
    # non-finite, and the block is recomputed from its initial states with masks.
    @pl.when(jnp.logical_not(jnp.isfinite(walk(masked=False))))
    def _masked():
        walk(masked=True)

    if geo.has_ht and edges is None:

        @pl.when(step == pl.num_programs(1) - 1)
        def _final():
            ht_ref[0] = after[...]


def fused_chunk_fwd(q, k, v, gate, h0, meta=None, *, geo: ForwardGeometry):
    """Outputs and final states.

    Args:
      q, k: [B, T*H, K] (the merged view of [B, T, H, K]); v: [B, T*H, V].
      gate: [B, H, T] float32 per-step log decays (floored, see `gla_core.kit.floor_cumsum_gates`).
      h0: [B, H, K, V] float32 initial states (varlen: [B*N, H, K, V]), or None.
      meta: for packed varlen rows (`geo.varlen`), the int32 [NT] per-chunk metadata (first, last,
        sequence, length) of their chunk layout; None for fixed length.
      geo: the static sizes of the call (T a multiple of `geo.block_tokens`).

    Returns:
      (o [B, T*H, V] in v's dtype, final states [B, H, K, V] float32 (varlen: [B*N, H, K, V]; an
      empty sequence's entry is not written) or None, the state before every chunk
      [B, NT, H, K, V] float32 or None unless `geo.has_states`).
    """
    b, rows, kdim = q.shape
    vdim = v.shape[-1]
    h_count, tb = geo.num_heads, geo.block_tokens
    seq_len = rows // h_count
    if seq_len % tb or tb % geo.chunk:
        raise ValueError(f"block_tokens: {tb} must divide T={seq_len} and be a multiple of the chunk {geo.chunk}")
    if heads_per_group(q.dtype) == 2 and h_count % 2:
        raise ValueError(f"num_heads: 16-bit inputs need an even head count, got {h_count}")
    key_block = pl.BlockSpec((1, tb * h_count, kdim), lambda bi, ti: (bi, ti, 0))
    value_block = pl.BlockSpec((1, tb * h_count, vdim), lambda bi, ti: (bi, ti, 0))
    gate_block = pl.BlockSpec((1, h_count, tb), lambda bi, ti: (bi, 0, ti))
    state_block = sequence_state_spec(geo, kdim, vdim)
    inputs, in_specs = [q, k, v, gate], [key_block, key_block, value_block, gate_block]
    if geo.has_h0:
        inputs.append(h0)
        in_specs.append(state_block)
    out_shape = [jax.ShapeDtypeStruct((b, rows, vdim), v.dtype)]
    out_specs = [value_block]
    if geo.has_ht:
        out_shape.append(jax.ShapeDtypeStruct((b * (geo.num_sequences or 1), h_count, kdim, vdim), F32))
        out_specs.append(state_block)
    if geo.has_states:
        nc = geo.chunks_per_block
        out_shape.append(jax.ShapeDtypeStruct((b, seq_len // geo.chunk, h_count, kdim, vdim), F32))
        out_specs.append(pl.BlockSpec((1, nc, h_count, kdim, vdim), lambda bi, ti: (bi, ti, 0, 0, 0)))
    tokens = b * rows
    c = geo.chunk
    flops = tokens * (2 * c * (kdim + vdim) + 4 * kdim * vdim + 6 * c)
    transcendentals = tokens * (c + 3)
    cost = cost_estimate(flops, transcendentals, [*inputs, *out_shape])
    # Double-buffered blocks plus the two-slot state scratch.
    vmem = 2 * (block_bytes(in_specs, inputs) + block_bytes(out_specs, out_shape)) + 2 * h_count * kdim * vdim * 4
    scratch = [
        pltpu.VMEM((2, h_count, kdim, vdim), F32),
        pltpu.VMEM((h_count, 1, tb), F32),
        pltpu.VMEM((h_count, 1, tb), F32),
    ]
    with jax.named_scope("fused_chunk_fwd"):
        outs = pl.pallas_call(
            lambda *refs: _forward_kernel(*refs, geo=geo),
            out_shape=out_shape,
            **time_grid_spec(geo, (b, seq_len // tb), in_specs, out_specs, scratch),
            compiler_params=sequential_in_time_params(vmem, heads=h_count, chunk=c, chunks=geo.chunks_per_block),
            interpret=interpret_params(geo.interpret),
            cost_estimate=cost,
            name="fused_chunk_fwd",
        )(*(meta or ()), *inputs)
    return outs[0], (outs[1] if geo.has_ht else None), (outs[-1] if geo.has_states else None)
