"""The `pallas_call`s shared by kernels of the same shape.

`launch_state_pass`: the two sequential state passes, `chunk_fwd_h` (states forwards in time)
and `chunk_bwd_dh` (state gradients backwards in time). Both read a row operand
`[B, H, Tp, K]`, a column operand `[B, H, Tp, V]`, the gate and optionally a per-sequence
state `[N, H, V, K]`; both write one float32 state per chunk `[B, H, NT, V, K]` and optionally
a per-sequence state, carrying a `[Vt, K]` float32 state in VMEM scratch along the "arbitrary"
time axis with the per-chunk metadata (first, last, sequence) scalar-prefetched.

`launch_output_pass`: the forward, `chunk_fwd`, the same sequential walk writing the outputs of
every chunk instead of the states (and, for the backward, its intra-chunk scores).

`launch_value_pass`: the fully parallel per-chunk pass with a value-shaped result,
`chunk_bwd_dv` (dv from k, do, the state gradients and the forward's scores)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_core.chunk.common import compiler_params, cost_estimate
from gla_core.chunk.gates import intra_costs, mask_table_inputs
from gla_core.chunk.specs import ChunkSpecs
from gla_core.tpu import KERNEL_VMEM_BUDGET_BYTES, interpret_params


def for_each_chunk(kernel, specs: ChunkSpecs, kinds: str, pass_chunk: bool = False):
    """A kernel written for one chunk, run for each of the n chunks of a grid step in order
    (`specs.chunks_per_step`). `kinds` has one letter per ref: "r" a time block `[n*C, ...]`
    (the chunk's rows are passed), "c" a per-chunk block `[n, ...]` (the chunk's entry), "s"
    shared by the chunks (scalar-prefetch refs, the gate's mask table, a carried state).
    `pass_chunk`: the kernel also takes `chunk_in_step`, the chunk's index within the step.
    Specs walking time backwards (`specs.reverse`) run a step's chunks from its last to its first."""
    n, c = specs.chunks_per_step, specs.chunk
    if n == 1:
        return functools.partial(kernel, chunk_in_step=0) if pass_chunk else kernel

    def view(ref, kind: str, chunk: int):
        if kind == "r":
            return ref.at[pl.ds(chunk * c, c)]
        return ref.at[chunk] if kind == "c" else ref

    def run(*refs):
        if len(refs) != len(kinds):
            raise ValueError(f"kinds: {len(kinds)} letters for {len(refs)} refs")
        for chunk in reversed(range(n)) if specs.reverse else range(n):
            views = (view(ref, kind, chunk) for ref, kind in zip(refs, kinds, strict=True))
            kernel(*views, **({"chunk_in_step": chunk} if pass_chunk else {}))

    return run


def step_edges(chunk_in_step: int, chunks_per_step: int, reverse: bool = False) -> tuple[bool, bool]:
    """Whether a chunk is the first and the last its grid step walks (static Python bools).

    With several chunks per step and one sequence per batch row (fixed length), sequences start
    and end only at step edges, so only those chunks may reset or emit a carried state: the chunks
    between them run without branches, and their independent work can overlap. (Packed sequences
    start and end at any chunk: see `carry_in_chunk`, `carry_out_chunk`.)"""
    walked = chunks_per_step - 1 - chunk_in_step if reverse else chunk_in_step
    return walked == 0, walked == chunks_per_step - 1


def carry_in(state_ref, step, starts, initial_ref) -> None:
    """The state a sequential walk carries, at its first grid step (zero) and where `starts`
    (a new sequence): `initial_ref` (float32) or zero."""

    @pl.when(step == 0)
    def _start():
        state_ref[...] = jnp.zeros(state_ref.shape, jnp.float32)

    @pl.when(starts)
    def _reset():
        if initial_ref is not None:
            state_ref[...] = initial_ref[...].astype(jnp.float32)
        else:
            state_ref[...] = jnp.zeros(state_ref.shape, jnp.float32)


def carry_in_step(state_ref, step, starts, initial_ref, packed: bool) -> None:
    """`carry_in` at the start of a grid step taken at once; packed sequences (`packed`, restarted
    inside the step's state chain, see `packed.ChainEdges`) only start from zero at the first step."""
    carry_in(state_ref, step, False if packed else starts, None if packed else initial_ref)


def carry_in_chunk(state_ref, walked, chunk, opens_step: bool, starts_ref, initial_ref, sequences) -> None:
    """`carry_in` for a kernel run chunk by chunk (`for_each_chunk`); `walked`: the chunks walked
    before this one. Fixed length (`sequences` None): at the step's first chunk, with the block of
    `initial_ref`. Packed (`packed.SequenceStates`): zero at the first chunk walked, then at every
    chunk that starts a sequence its initial state."""
    if sequences is None:
        if opens_step:
            carry_in(state_ref, walked, starts_ref[chunk] == 1, initial_ref)
        return
    if opens_step:
        carry_in(state_ref, walked, False, None)
    sequences.reset(state_ref, chunk)


def carry_out_chunk(state_ref, state, chunk, closes_step: bool, ends_ref, final_ref, sequences) -> None:
    """Writes the carried state (`state`, the value just stored in `state_ref`) where `chunk` ends a
    sequence (`final_ref` None: not wanted). Fixed length (`sequences` None): at the step's last
    chunk, into the block of `final_ref`. Packed (`packed.SequenceStates`): at any chunk, by DMA
    from `state_ref`."""
    if sequences is not None:
        sequences.emit(state_ref, chunk)
        return
    if final_ref is not None and closes_step:

        @pl.when(ends_ref[chunk] == 1)
        def _final():
            final_ref[...] = state


def launch_state_pass(
    name: str,
    kernel,
    row: jax.Array,
    column: jax.Array,
    gate: jax.Array,
    state_in: jax.Array | None,
    first: jax.Array,
    last: jax.Array,
    sequence: jax.Array,
    *,
    specs: ChunkSpecs,
    state_out: bool,
    interpret: bool,
) -> tuple[jax.Array, jax.Array | None]:
    """Runs a scalar gate's `kernel(first, last, sequence, row, column, gate, [state_in], per_chunk,
    [state_out], scratch, chunk_in_step=)` for every chunk in walking order (several chunks per grid
    step, see `for_each_chunk`); a per-key gate's `kernel(first, last, sequence, row, column, gate,
    [state_in], table, per_chunk, [state_out], scratch)` once per grid step for all its chunks
    (`table`: its `KeyMaskTable`).

    Returns (per-chunk states [B, H, NT, V, K] float32, per-sequence states [N, H, V, K] float32
    or None unless `state_out`).
    """
    b, h, tp, kdim = row.shape
    vdim = column.shape[-1]
    nt, nv = specs.num_chunks, specs.num_tiles
    per_chunk = jax.ShapeDtypeStruct((b, h, nt, vdim, kdim), jnp.float32)
    gate_flops, gate_transcendentals = intra_costs(specs.gate_mode, specs.chunk, kdim, products=0)
    flops = b * h * nv * nt * gate_flops + 2 * b * h * tp * kdim * vdim + 3 * b * h * nt * kdim * vdim
    # first, last, sequence; row, column, gate, [state_in]; per_chunk, [state_out]; the carried state
    kinds = "sss" + "rrc" + "s" * (state_in is not None) + "c" + "s" * state_out + "s"
    (states,), state = sequential_call(
        name,
        kernel if specs.per_step else for_each_chunk(kernel, specs, kinds, pass_chunk=True),
        [row, column, gate],
        [specs.key(), specs.value(), specs.gate()],
        state_in,
        (first, last, sequence),
        [(per_chunk, specs.chunk_state())],
        specs=specs,
        state_out=state_out,
        flops=flops,
        transcendentals=b * h * nv * nt * gate_transcendentals,
        interpret=interpret,
    )
    return states, state


def launch_output_pass(
    name: str,
    kernel,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    gate: jax.Array,
    state_in: jax.Array | None,
    first: jax.Array,
    last: jax.Array,
    sequence: jax.Array,
    *,
    specs: ChunkSpecs,
    state_out: bool,
    scores_dtype=None,
    keep_states: bool = False,
    anchored: bool = False,
    interpret: bool,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array | None]:
    """Runs a scalar gate's `kernel(first, last, sequence, q, k, v, gate, [state_in], o, [scores],
    [states], [state_out], scratch, chunk_in_step=)` for every chunk in order (several chunks per
    grid step, see `for_each_chunk`), a per-key gate's `kernel(..., gate, [state_in], table, o, ...)`
    once per grid step: the forward pass that carries the state along time and writes the outputs
    of every chunk, given `scores_dtype` every chunk's intra-chunk scores, and with `keep_states`
    the state before every chunk. `anchored`: the kernel takes anchored products (cost estimate).

    Returns (o [B, H, Tp, V] in v's dtype, per-sequence states [N, H, V, K] float32 or None unless
    `state_out`, scores [B, H, NF, NT, C, C] in `scores_dtype` (one copy per V tile) or None,
    states before every chunk [B, H, NT, V, K] float32 or None).
    """
    b, hh, _, kdim = q.shape
    nv, nt, c = specs.num_tiles, specs.num_chunks, specs.chunk
    gate_flops, transcendentals = intra_costs(specs.gate_mode, c, kdim, products=1, anchored=anchored)
    has_scores = scores_dtype is not None
    if not specs.per_step:
        # first, last, sequence; q, k, v, gate, [state_in]; o, [scores], [states], [state_out]; the carried state
        kinds = "sss" + "rrrc" + "s" * (state_in is not None) + "r"
        kinds += "c" * has_scores + "c" * keep_states + "s" * state_out + "s"
        kernel = for_each_chunk(kernel, specs, kinds, pass_chunk=True)
    per_chunk = 4 * c * kdim * specs.block_v + 2 * c * c * specs.block_v + 3 * kdim * specs.block_v
    outputs = [(jax.ShapeDtypeStruct(v.shape, v.dtype), specs.value())]
    if has_scores:
        scores = jax.ShapeDtypeStruct((b, hh, nv, nt, c, c), scores_dtype)
        outputs.append((scores, specs.chunk_scores()))
    if keep_states:
        outputs.append((jax.ShapeDtypeStruct((b, hh, nt, v.shape[-1], kdim), jnp.float32), specs.chunk_state()))
    per_chunk_outputs, state = sequential_call(
        name,
        kernel,
        [q, k, v, gate],
        [specs.key(), specs.key(), specs.value(), specs.gate()],
        state_in,
        (first, last, sequence),
        outputs,
        specs=specs,
        state_out=state_out,
        flops=b * hh * nv * nt * (gate_flops + per_chunk),
        transcendentals=b * hh * nv * nt * transcendentals,
        interpret=interpret,
    )
    scores = per_chunk_outputs[1] if has_scores else None
    return per_chunk_outputs[0], state, scores, (per_chunk_outputs[-1] if keep_states else None)


def sequential_call(
    name: str,
    kernel,
    inputs: list,
    in_specs: list,
    state_in: jax.Array | None,
    meta: tuple[jax.Array, jax.Array, jax.Array],
    outputs: list[tuple[jax.ShapeDtypeStruct, pl.BlockSpec]],
    *,
    specs: ChunkSpecs,
    state_out: bool,
    flops: int,
    transcendentals: int,
    interpret: bool,
) -> tuple[list[jax.Array], jax.Array | None]:
    """A `pallas_call` walking time in order ("arbitrary") with a `[Vt, K]` float32 state in VMEM
    scratch, the per-chunk metadata scalar-prefetched, an optional per-sequence state in and out
    and the gate's mask table.
    `outputs`: (shape, block) of the outputs written chunk by chunk.
    Returns (those outputs, the per-sequence states or None)."""
    kdim = inputs[0].shape[-1]
    inputs, in_specs = list(inputs), list(in_specs)
    if state_in is not None:
        in_specs.append(specs.state_of_sequence())
        inputs.append(state_in)
    table, table_spec = mask_table_inputs(specs.gate_mode, specs.chunk)
    inputs += table
    in_specs += table_spec
    out_shape = [shape for shape, _ in outputs]
    out_specs = [spec for _, spec in outputs]
    if state_out:
        b, h = inputs[0].shape[:2]
        out_shape.append(jax.ShapeDtypeStruct((b * specs.states_per_row, h, specs.value_dim, kdim), jnp.float32))
        out_specs.append(specs.state_of_sequence())
    cost = cost_estimate(flops, transcendentals, [*inputs, *out_shape])
    with jax.named_scope(name):
        outs = pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=len(meta),
                grid=specs.grid(*inputs[0].shape[:2]),
                in_specs=in_specs,
                out_specs=out_specs,
                scratch_shapes=[pltpu.VMEM((specs.block_v, kdim), jnp.float32)],
            ),
            compiler_params=compiler_params(
                "parallel", "parallel", "parallel", "arbitrary", vmem_limit_bytes=_vmem_limit(specs)
            ),
            interpret=interpret_params(interpret),
            cost_estimate=cost,
            name=name,
        )(*meta, *inputs)
    return list(outs[: len(outputs)]), (outs[len(outputs)] if state_out else None)


def _vmem_limit(specs: ChunkSpecs) -> int | None:
    """The scoped VMEM limit of a sequential kernel: `KERNEL_VMEM_BUDGET_BYTES` for the per-key
    kernels of packed calls (all n chunks of a step at once: the fused backward at n = 4, C = 128,
    K = V = 128 takes 18.5 MiB on v5e, above Mosaic's default of 16), else Mosaic's default."""
    return KERNEL_VMEM_BUDGET_BYTES if specs.packed and specs.per_step else None


def launch_value_pass(
    name: str,
    kernel,
    k: jax.Array,
    value: jax.Array,
    gate: jax.Array,
    states: jax.Array,
    scores: jax.Array,
    *,
    specs: ChunkSpecs,
    out_dtype,
    interpret: bool,
) -> jax.Array:
    """Runs a scalar gate's `kernel(k, value, gate, states, scores, out)` for every chunk
    (`for_each_chunk`), a per-key gate's `kernel(k, value, gate, states, scores, table, out)` once per
    grid step (`table`: its `KeyMaskTable`), over (B, H, V tiles, time blocks) all parallel.

    k [B, H, Tp, K]; value [B, H, Tp, V]; states [B, H, NT, V, K] float32 (one per chunk);
    scores [B, H, NF, NT, C, C] (the forward's, one copy per V tile). Returns [B, H, Tp, V] in `out_dtype`.
    """
    b, hh, tp, kdim = k.shape
    vdim = value.shape[-1]
    nv, nt, c = specs.num_tiles, specs.num_chunks, specs.chunk
    out_shape = jax.ShapeDtypeStruct((b, hh, tp, vdim), out_dtype)
    flops, transcendentals = intra_costs(specs.gate_mode, c, kdim, products=0)
    flops = b * hh * nv * nt * (flops + 2 * c * kdim * specs.block_v + 2 * c * c * specs.block_v)
    transcendentals = b * hh * nv * nt * transcendentals
    table, table_spec = mask_table_inputs(specs.gate_mode, c)
    with jax.named_scope(name):
        return pl.pallas_call(
            kernel if specs.per_step else for_each_chunk(kernel, specs, "rrccc" + "r"),
            out_shape=out_shape,
            grid=specs.grid(b, hh),
            in_specs=[specs.key(), specs.value(), specs.gate(), specs.chunk_state(), specs.chunk_scores(), *table_spec],
            out_specs=specs.value(),
            compiler_params=compiler_params("parallel", "parallel", "parallel", "parallel"),
            interpret=interpret_params(interpret),
            cost_estimate=cost_estimate(flops, transcendentals, [k, value, gate, states, scores, out_shape]),
            name=name,
        )(k, value, gate, states, scores, *table)
