"""`fused_chunk_bwd`: the whole backward in one kernel, walking time backwards on the op's layouts.

Per head and chunk, from the last chunk to the first (b_t the chunk's cumulative log decay
through t, L its last step, S the state before the chunk, stored by the forward, G the
gradient of the state after it, carried in VMEM from `dht` or zero):

    D_ts = scale * e^{b_t - b_s} (t >= s, else 0)      P = (do v^T) * D     A = (q k^T) * D
    dq   = P k + e^{b_t} scale * do S^T
    dk   = P^T q + e^{b_L - b_s} v G^T
    dv   = A^T do + e^{b_L - b_s} k G
    G   <- e^{b_L} G + scale * (e^{b_t} q)^T do

After the first chunk G is the initial-state gradient. The gate gradient (d loss / d a_u of the
per-step log decay) is summed in XLA from two per-token terms the kernel emits as `[2, Tb]` rows
per head, each term already restricted to the steps u its decay spans, so nothing that cancels
exactly is computed (see `_chunk_gradients` and `gate_gradient`).

Grid, blocks and exponents as in `forward` (all heads of Tb tokens per grid step, the op's
`[B, T*H, D]` views, compensated cumsums, exponents <= 0 wherever they are used). Packed varlen
rows as in `forward`, walking backwards: G restarts from `dht[seq]` (or zero) at the last chunk of
every sequence and is written to `dh0[seq]` after its first chunk (`forward.SequenceEdges`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_core.kit import (
    CUMSUM_GATE_FLOOR,
    NN,
    NT,
    TN,
    HeadRows,
    chunk_cumsum,
    cost_estimate,
    dot,
    interpret_params,
)
from gla_fused.fused_chunk.forward import (
    ChunkDecays,
    ForwardGeometry,
    SequenceEdges,
    block_bytes,
    sequence_state_spec,
    sequential_in_time_params,
    time_grid_spec,
)

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class BackwardGeometry:
    """Static sizes of one backward call: the forward's, plus whether `dht` is given and `dh0` wanted,
    and whether the state products of the gate terms keep twice the bits (`_state_dot`)."""

    forward: ForwardGeometry
    has_dht: bool
    has_dh0: bool
    split_state_products: bool = False


def _state_dot(a, state, dims, dtype, split: bool):
    """`dot(a, state)` for a float32 `state`; with `split`, as two `dtype` products of its high and low
    parts (for bfloat16 `a`, the state's ~16 leading bits instead of 8, at twice the MXU passes)."""
    if not split:
        return dot(a, state, dims, dtype)
    high = state.astype(dtype)
    low = state - high.astype(F32)
    return dot(a, high, dims, dtype) + dot(a, low, dims, dtype)


def _row_sums(x):
    """The sum of every row of float32 `x` [N, M] as a row [1, N].

    Transposed, then summed over sublanes: by libtpu's static estimate (v6e) far cheaper than lane
    sums, which give a column [N, 1] that a relayout then turns into the row."""
    return jnp.sum(x.T, axis=0, keepdims=True)


def _chunk_gradients(q, k, v, do, state, grad, decays: ChunkDecays, dtype, split_states: bool):
    """One head's chunk: (dq, dk, dv [C, D] float32, the gate term rows `after` and `before` [1, C],
    the gradient of the state before the chunk [K, V]).

    `dtype` is the matmul operand dtype. `split_states`: the products with the float32 state and its
    gradient, which the gate terms sum, keep twice the state's bits (`_state_dot`). Asked when
    d g_gamma is needed for bfloat16 inputs: that sum over the batch can cancel to a small part of its
    terms, and bfloat16 states were 8% of it on a fuzzed case."""
    d = decays.intra()  # scale * e^{b_t - b_s}, zero above the diagonal
    scores = dot(q, k, NT, dtype)  # [t, s]
    p = dot(do, v, NT, dtype) * d
    from_start = decays.from_start()  # scale * e^{b_t}: [C, 1]
    to_end = decays.to_end().reshape(-1, 1)  # e^{b_L - b_s}: [C, 1]
    dq_inter = _state_dot(do, state, NT, dtype, split_states) * from_start
    dq = dot(p, k, NN, dtype) + dq_inter
    dk_state = _state_dot(v, grad, NT, dtype, split_states) * to_end
    dk = dot(p, q, TN, dtype) + dk_state
    dv = dot(scores * d, do, TN, dtype) + dot(k, grad, NN, dtype) * to_end
    increment = dot(q.astype(F32) * from_start, do, TN, dtype)  # scale * sum_t e^{b_t} q_t^T do_t: [K, V]
    previous = grad * decays.whole() + increment
    # d loss / d a_u sums, over every term, the steps u the term's decay spans: a pair (t, s) of the
    # intra products spans s < u <= t (the diagonal none, so it is left out rather than cancelled);
    # the inter term of q_t, u <= t; the state term of k_s, u > s; the decayed state, every u.
    strict = jnp.where(decays.causal & ~decays.diagonal, p * scores, 0.0)  # [t, s]
    qf, kf = q.astype(F32), k.astype(F32)
    after = _row_sums(qf * dq_inter) + _row_sums(strict) - jnp.sum(strict, axis=0, keepdims=True)
    # <S, G> as [1, 1]: sublanes, then lanes, with no scalar between the vector ops
    decayed_state = jnp.sum(jnp.sum(state * grad, axis=0, keepdims=True), axis=1, keepdims=True)
    after = after + jnp.where(decays.last_step, decays.whole() * decayed_state, 0.0)
    before = _row_sums(kf * dk_state)
    return dq, dk, dv, after, before, previous


def _backward_kernel(*refs, geo: BackwardGeometry):
    fwd = geo.forward
    meta, refs = (refs[:4], refs[4:]) if fwd.varlen else (None, refs)  # first, last, sequence, length [NT]
    q_ref, k_ref, v_ref, do_ref, gate_ref, states_ref = refs[:6]  # token-major blocks, [1, H, Tb], [1, NC, H, K, V]
    dht_ref = refs[6] if geo.has_dht else None  # [1, H, K, V] (varlen: [B*N, H, K, V] in HBM)
    outs = refs[6 + geo.has_dht :]
    dq_ref, dk_ref, dv_ref, terms_ref = outs[:4]  # token-major blocks, [1, H, 2, Tb] float32
    dh0_ref = outs[4] if geo.has_dh0 else None  # [1, H, K, V] (varlen: [B*N, H, K, V] in HBM)
    grad_ref, hi_ref, lo_ref = refs[-3:]  # [H, K, V], [H, 1, Tb], [H, 1, Tb] float32
    step = pl.program_id(1)
    c, h_count = fwd.chunk, fwd.num_heads
    edges = None
    if fwd.varlen:  # walking backwards, a sequence starts at its last chunk and ends at its first
        first_ref, last_ref, sequence_ref, length_ref = meta
        edges = SequenceEdges(fwd.num_sequences, last_ref, first_ref, sequence_ref, length_ref, dht_ref, dh0_ref)
    block = pl.num_programs(1) - 1 - step  # the time block of this grid step

    @pl.when(step == 0)
    def _start():
        grad_ref[...] = dht_ref[0] if geo.has_dht and edges is None else jnp.zeros(grad_ref.shape, F32)

    hi, lo = chunk_cumsum(gate_ref[0], c)
    hi_ref[...] = hi[:, None, :]
    lo_ref[...] = lo[:, None, :]
    rows = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    causal = rows >= jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    log_scale = math.log(fwd.scale)
    readers = [HeadRows(r, h_count, fwd.interpret) for r in (q_ref, k_ref, v_ref, do_ref)]
    writers = [HeadRows(r, h_count, fwd.interpret) for r in (dq_ref, dk_ref, dv_ref)]
    group = readers[0].group
    split_states = geo.split_state_products and fwd.mxu_dtype != jnp.dtype(F32)
    for chunk in reversed(range(fwd.chunks_per_block)):
        first = chunk * c
        window = pl.ds(first, c)
        if edges is not None:
            edges.restart(grad_ref, block * fwd.chunks_per_block + chunk)
            real = edges.real_steps(block * fwd.chunks_per_block + chunk, c)
        for head in range(0, h_count, group):
            loaded = zip(*(r.load(first, c, head) for r in readers), strict=True)
            results = []
            for h, (q, k, v, do) in zip(range(head, head + group), loaded, strict=True):
                if edges is not None:
                    q, k, v, do = edges.masked(real, q, k, v, do)
                decays = ChunkDecays(hi_ref[h, :, window], lo_ref[h, :, window], causal, log_scale)
                state = states_ref[0, chunk, h]
                dq, dk, dv, after, before, previous = _chunk_gradients(
                    q, k, v, do, state, grad_ref[h], decays, fwd.mxu_dtype, split_states
                )
                grad_ref[h] = previous
                terms_ref[0, h, 0:1, window] = after
                terms_ref[0, h, 1:2, window] = before
                results.append((dq, dk, dv))
            for writer, values in zip(writers, zip(*results, strict=True), strict=True):
                writer.store(first, head, values)
        if edges is not None:
            edges.emit(grad_ref, block * fwd.chunks_per_block + chunk)

    if geo.has_dh0 and edges is None:

        @pl.when(step == pl.num_programs(1) - 1)
        def _final():
            dh0_ref[0] = grad_ref[...]


def fused_chunk_bwd(q, k, v, do, gate, states, dht, meta=None, *, geo: BackwardGeometry):
    """Gradients of q, k, v and the initial state, and the per-token gate terms.

    Args:
      q, k: [B, T*H, K]; v, do: [B, T*H, V] (merged views; do in the compute dtype).
      gate: [B, H, T] float32 floored log decays (as the forward's).
      states: [B, NT, H, K, V] float32, the state before every chunk (the forward's `states`).
      dht: [B, H, K, V] float32 final-state cotangent (varlen: [B*N, H, K, V]), or None.
      meta: the per-chunk metadata (first, last, sequence, length) of packed varlen rows, as in
        `forward.fused_chunk_fwd`; None for fixed length.
      geo: the static sizes.

    Returns:
      (dq [B, T*H, K], dk [B, T*H, K], dv [B, T*H, V] in the compute dtype's float32 accumulation
      cast to q's/v's dtype, terms [B, H, 2, T] float32 (see the module doc), dh0 [B, H, K, V]
      float32 (varlen: [B*N, H, K, V]; an empty sequence's entry is not written) or None).
    """
    fwd = geo.forward
    b, rows, kdim = q.shape
    vdim = v.shape[-1]
    h_count, tb, c = fwd.num_heads, fwd.block_tokens, fwd.chunk
    seq_len = rows // h_count
    blocks = seq_len // tb
    nc = fwd.chunks_per_block

    def reverse(bi, ti):
        return bi, blocks - 1 - ti

    def token_block(dim):
        return pl.BlockSpec((1, tb * h_count, dim), lambda bi, ti: (*reverse(bi, ti), 0))

    gate_block = pl.BlockSpec((1, h_count, tb), lambda bi, ti: (bi, 0, reverse(bi, ti)[1]))
    states_block = pl.BlockSpec((1, nc, h_count, kdim, vdim), lambda bi, ti: (*reverse(bi, ti), 0, 0, 0))
    state_block = sequence_state_spec(fwd, kdim, vdim)
    terms_block = pl.BlockSpec((1, h_count, 2, tb), lambda bi, ti: (bi, 0, 0, reverse(bi, ti)[1]))
    inputs = [q, k, v, do, gate, states]
    in_specs = [token_block(kdim), token_block(kdim), token_block(vdim), token_block(vdim), gate_block, states_block]
    if geo.has_dht:
        inputs.append(dht)
        in_specs.append(state_block)
    out_shape = [
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        jax.ShapeDtypeStruct((b, h_count, 2, seq_len), F32),
    ]
    out_specs = [token_block(kdim), token_block(kdim), token_block(vdim), terms_block]
    if geo.has_dh0:
        out_shape.append(jax.ShapeDtypeStruct((b * (fwd.num_sequences or 1), h_count, kdim, vdim), F32))
        out_specs.append(state_block)
    tokens = b * rows
    flops = tokens * (4 * c * (kdim + vdim) + 10 * kdim * vdim)
    cost = cost_estimate(flops, tokens * (c + 3), [*inputs, *out_shape])
    # Double-buffered blocks plus the state-gradient scratch.
    vmem = 2 * (block_bytes(in_specs, inputs) + block_bytes(out_specs, out_shape)) + h_count * kdim * vdim * 4
    scratch = [
        pltpu.VMEM((h_count, kdim, vdim), F32),
        pltpu.VMEM((h_count, 1, tb), F32),
        pltpu.VMEM((h_count, 1, tb), F32),
    ]
    with jax.named_scope("fused_chunk_bwd"):
        outs = pl.pallas_call(
            lambda *refs: _backward_kernel(*refs, geo=geo),
            out_shape=out_shape,
            **time_grid_spec(fwd, (b, blocks), in_specs, out_specs, scratch),
            compiler_params=sequential_in_time_params(vmem, heads=h_count, chunk=c, chunks=nc),
            interpret=interpret_params(fwd.interpret),
            cost_estimate=cost,
            name="fused_chunk_bwd",
        )(*(meta or ()), *inputs)
    dq, dk, dv, terms = outs[:4]
    return dq, dk, dv, terms, (outs[4] if geo.has_dh0 else None)


def gate_gradient(terms, gate, chunk: int):
    """d loss / d a_u of the per-step log decays from the backward kernel's terms.

        d a_u = sum_{t >= u in u's chunk} after_t + sum_{s < u in u's chunk} before_s

    (see `_chunk_gradients`). Gates at or below the kernel floor (hard resets) get exactly 0.

    Args:
      terms: [B, H, 2, T] float32 from `fused_chunk_bwd` (after, before).
      gate: [B, H, T] float32, the floored log decays the kernels saw.
      chunk: the kernels' chunk C (T a multiple of it).

    Returns:
      [B, H, T] float32.
    """
    b, h, _, t = terms.shape
    after, before = (terms[:, :, i].reshape(b, h, t // chunk, chunk) for i in (0, 1))
    from_here = jnp.flip(jnp.cumsum(jnp.flip(after, -1), axis=-1), -1)
    # Exclusive prefix sums by shifting, not by subtracting: the state term of the chunk's last step
    # is the largest (its decay is 1) and reaches no step of the chunk.
    before_here = jnp.cumsum(jnp.pad(before[..., :-1], [(0, 0)] * 3 + [(1, 0)]), axis=-1)
    da = (from_here + before_here).reshape(b, h, t)
    return jnp.where(gate <= CUMSUM_GATE_FLOOR, 0.0, da)
