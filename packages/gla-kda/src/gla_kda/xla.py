"""kda implementation `xla`: chunked KDA in plain `jnp` (every backend; the CPU/GPU default).

Pipeline (FLA's chunk_kda algorithm, see `gla_kda.xla_intra` for the math):
  1. prepare the inputs (l2norm, in-kernel gate and the log-decay floor, beta sigmoid, scale:
     `gla_kda.inputs`), replace non-finite inputs by zeros (`gla_kda.nonfinite`: the outputs
     they reach are set to NaN at the end), expand q/k to the value heads, and lay the sequence
     out in chunks `[NT, B*HV, C, D]` (varlen: `gla_core.varlen`, each chunk inside one sequence);
  2. intra-chunk WY quantities for all chunks at once (batched GEMMs; (I + Akk)^-1 by blocked
     forward substitution in jnp, no LAPACK call);
  3. the delta-rule-corrected state recurrence across chunks (`lax.scan`, one small GEMM pair
     per chunk), resetting the state at every sequence start;
  4. output `o = qg S + Aqk delta` for all chunks at once.

Backward: plain JAX autodiff of this pipeline (a `custom_vjp` replaying `jax.vjp` was measured
no faster and was removed), so the gradient is the exact gradient of the computed function: the
masked, cancellation-free decays keep every intermediate finite. `prepare_inputs`' pieces carry
their own stable `custom_vjp`s. The per-sub-block [c, c, K] decay tensors (c = 8 times the size
of k) are not stored but recomputed in the backward (`jax.checkpoint` in `gla_kda.xla_intra`);
the rest is a few tensors of the size of q/k/v, the [C, C] score matrices and one state per chunk.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gla_kda.chunking import ChunkGrid, flat, select_initial_state, zero_state
from gla_kda.empty import result_without_tokens
from gla_kda.gate import compute_dtype
from gla_kda.inputs import expand_value_heads, prepare_inputs
from gla_kda.nonfinite import NonFiniteGuard
from gla_kda.xla_intra import DEFAULT_SUB_BLOCK, einsum, intra_chunk


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """Static configuration of one chunked run."""

    chunk_size: int
    output_final_state: bool
    sub_block: int = DEFAULT_SUB_BLOCK
    recompute: bool = True  # False: FLA's disable_recompute (keep the largest intermediate for the backward)


# --------------------------------------------------------------------------- forward


def _state_recurrence(intra, initial_state, grid: ChunkGrid):
    """States entering every chunk and the corrected values (scan over chunks).

    Args:
      intra: `IntraChunk` with leading axes [NT, B*HV].
      initial_state: [N, HV, K, V] (N = B without varlen).
      grid: the chunk grid (varlen: reset to `initial_state[n]` at the first chunk of sequence n).

    Returns:
      (states [NT, B*HV, K, V] entering each chunk, delta [NT, B*HV, C, V], last carry [B*HV, K, V]).
    """

    def step(state, chunk):
        w, u, kd, gamma, first, sequence = chunk
        if grid.varlen:
            state = select_initial_state(state, initial_state, first, sequence)
        delta = u - einsum("bck,bkv->bcv", w, state)
        new_state = gamma[..., None] * state + einsum("bck,bcv->bkv", kd, delta)
        return new_state, (state, delta)

    carry = initial_state[0] if grid.varlen else initial_state.reshape((-1, *initial_state.shape[2:]))
    first, sequence = grid.chunk_flags()
    last, (states, delta) = jax.lax.scan(step, carry, (intra.w, intra.u, intra.kd, intra.gamma, first, sequence))
    return states, delta, last


def _final_states(intra, states, delta, last, initial_state, grid: ChunkGrid):
    """[N, HV, K, V] state after each sequence (its initial state when the sequence is empty)."""
    if not grid.varlen:
        return last.reshape(initial_state.shape)
    index = grid.last_chunks()  # varlen: B = 1, so the merged axis is HV
    state = flat(states[index])
    end = flat(intra.gamma[index])[..., None] * state + einsum(
        "bck,bcv->bkv", flat(intra.kd[index]), flat(delta[index])
    )
    return jnp.where(grid.empty_sequences(), initial_state, end.reshape(initial_state.shape))


def chunked_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, config: ChunkConfig):
    """Chunked KDA on prepared inputs.

    Args:
      q, k: [B, T, H, K] float32 (q scaled); v: [B, T, HV, V]; g: [B, T, HV, K] log decay;
      beta: [B, T, HV]; initial_state: [N, HV, K, V] or None; cu_seqlens: [N+1] int32 or None.
      config: chunk size, whether to return the final state, sub-block size.

    Returns:
      (o [B, T, HV, V] float32, final_state [N, HV, K, V] float32 or None, states [NT, B*HV, K, V]
      entering every chunk of the chunk grid).
    """
    batch, seq_len, heads, value_dim = v.shape
    key_dim = k.shape[-1]
    dtype = q.dtype
    grid = ChunkGrid.build(batch, seq_len, heads, config.chunk_size, cu_seqlens)
    num_states = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is None:
        initial_state = zero_state(num_states, heads, key_dim, value_dim, dtype)
    initial_state = initial_state.astype(dtype)

    q, k = expand_value_heads(q, heads), expand_value_heads(k, heads)
    qc, kc, vc, gc, bc = grid.to_chunks_together([q, k, v, g, beta[..., None]])
    num_chunks, merged = qc.shape[:2]
    intra = intra_chunk(flat(qc), flat(kc), flat(vc), flat(gc), flat(bc)[..., 0], config.sub_block, config.recompute)
    intra = jax.tree.map(lambda x: x.reshape((num_chunks, merged, *x.shape[1:])), intra)
    states, delta, last = _state_recurrence(intra, initial_state, grid)
    o = einsum("bck,bkv->bcv", flat(intra.qg), flat(states)) + einsum("bcj,bjv->bcv", flat(intra.Aqk), flat(delta))
    o = grid.from_chunks(o.reshape((num_chunks, merged, *o.shape[1:])))
    final = _final_states(intra, states, delta, last, initial_state, grid) if config.output_final_state else None
    return o, final, states


def intermediate_states(states, batch: int, heads: int, seq_len: int, chunk_size: int, boundaries, dtype):
    """FLA's `return_intermediate_states`: the state entering every chunk, [B, NT, HV, K, V] in `dtype`.

    `states` [NT', B*HV, K, V] enter the chunks of the chunk grid; NT = ceil(T / C), or with packed
    sequences (host `boundaries`, B = 1) the sum of ceil(len_n / C): the grid holds each sequence's
    chunks in order first, then padding chunks.
    """
    if boundaries is None:
        count = -(-seq_len // chunk_size)
    else:
        lengths = np.diff(np.asarray(boundaries))
        count = int(np.sum(-(-lengths // chunk_size)))
    h = states[:count].reshape(count, batch, heads, *states.shape[2:])
    return jnp.swapaxes(h, 0, 1).astype(dtype)


# --------------------------------------------------------------------------- implementation


def kda_xla(args):
    """kda through the chunked `jnp` pipeline, on the call's validated arguments record.

    Returns (o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32 (float64 for float64
    inputs) or None), and with `return_intermediate_states` the state entering every chunk
    `[B, NT, HV, K, V]` in q's dtype (`intermediate_states`; not marked NaN for non-finite inputs).
    `disable_recompute` keeps the diagonal blocks' decay tensor for the backward instead of
    rematerializing it.
    """
    empty = result_without_tokens(args, compute_dtype(args.q.dtype))
    if empty is not None:
        if not args.return_intermediate_states:
            return empty
        batch, _, heads, value_dim = args.v.shape
        return (*empty, jnp.zeros((batch, 0, heads, args.q.shape[-1], value_dim), args.q.dtype))
    v, initial_state, cu_seqlens = args.v, args.initial_state, args.cu_seqlens
    prepared = prepare_inputs(args)
    config = ChunkConfig(
        chunk_size=args.chunk_size, output_final_state=args.output_final_state, recompute=not args.disable_recompute
    )
    guard, finite = NonFiniteGuard.build(
        prepared.q, prepared.k, prepared.v, prepared.g, prepared.beta, initial_state, cu_seqlens
    )
    o, final, states = chunked_delta_rule(*finite, cu_seqlens, config)
    o, final = guard.apply(o, final)
    if not args.return_intermediate_states:
        return o.astype(v.dtype), final
    batch, seq_len, heads = v.shape[:3]
    h = intermediate_states(states, batch, heads, seq_len, args.chunk_size, args.cu_seqlens_cpu, args.q.dtype)
    return o.astype(v.dtype), final, h
