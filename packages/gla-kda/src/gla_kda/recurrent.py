"""kda implementation `recurrent`: the token-by-token delta rule under `lax.scan` (decode path).

Per step, for every (batch, value head), in float32:

    S <- diag(exp(g_t)) S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = q_t^T S                                  (q already scaled)

Time is cut into segments of `chunk_size` steps (fewer when T is shorter, so T = 1 decode
runs one step): an outer `lax.scan` over segments carries the state, an inner one runs the
steps. With `cu_seqlens` the segments come from `gla_core.varlen`, so every segment belongs
to one sequence and the state resets to that sequence's initial state at its first segment.

Backward: JAX autodiff of the scans, exact (the gradient of the computed recurrence). Each
segment is wrapped in `jax.checkpoint`, so the forward keeps only the state entering every
segment (T / chunk_size states) and the backward recomputes one segment's per-step states at
a time: memory O((T / C + C) * K * V) per head instead of O(T * K * V).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gla_kda.chunking import ChunkGrid, select_initial_state, zero_state
from gla_kda.empty import result_without_tokens
from gla_kda.gate import compute_dtype
from gla_kda.inputs import expand_value_heads, prepare_inputs
from gla_kda.xla_intra import einsum


def _step(state, token):
    """One delta-rule step for every (batch, head): state [BH, K, V]; token q, k, g [BH, K], v [BH, V], beta [BH]."""
    q, k, v, g, beta = token
    state = jnp.exp(g)[..., None] * state
    delta = beta[..., None] * (v - einsum("bk,bkv->bv", k, state))
    state = state + k[..., None] * delta[..., None, :]
    return state, einsum("bk,bkv->bv", q, state)


def recurrent_delta_rule(
    q, k, v, g, beta, initial_state, cu_seqlens, output_final_state: bool, segment: int, recompute: bool = True
):
    """The recurrence on prepared inputs.

    Args:
      q, k: [B, T, H, K] float32 (q scaled); v: [B, T, HV, V]; g: [B, T, HV, K] log decay;
      beta: [B, T, HV]; initial_state: [N, HV, K, V] or None; cu_seqlens: [N+1] int32 or None.
      output_final_state: return the state after each sequence.
      segment: steps per checkpointed segment (capped at T).
      recompute: checkpoint the segments (recompute their states in the backward); False keeps
        every step's state (FLA's disable_recompute: memory for speed).

    Returns:
      (o [B, T, HV, V] float32, final_state [N, HV, K, V] float32 or None).
    """
    batch, seq_len, heads, value_dim = v.shape
    key_dim = k.shape[-1]
    dtype = q.dtype
    grid = ChunkGrid.build(batch, seq_len, heads, max(1, min(segment, seq_len)), cu_seqlens)
    num_states = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is None:
        initial_state = zero_state(num_states, heads, key_dim, value_dim, dtype)
    initial_state = initial_state.astype(dtype)

    q, k = expand_value_heads(q, heads), expand_value_heads(k, heads)
    # [NT, BH, C, D] -> [NT, C, BH, D]: time-major inside each segment.
    tokens = tuple(jnp.swapaxes(x, 1, 2) for x in grid.to_chunks_together([q, k, v, g, beta[..., None]]))
    first, sequence = grid.chunk_flags()

    def run_segment(state, segment_inputs):
        (qs, ks, vs, gs, bs), first, sequence = segment_inputs
        if grid.varlen:
            state = select_initial_state(state, initial_state, first, sequence)
        state, o = jax.lax.scan(_step, state, (qs, ks, vs, gs, bs[..., 0]))
        return state, (o, state if grid.varlen and output_final_state else None)

    carry = initial_state[0] if grid.varlen else initial_state.reshape((-1, *initial_state.shape[2:]))
    step = jax.checkpoint(run_segment) if recompute else run_segment
    last, (o, ends) = jax.lax.scan(step, carry, (tokens, first, sequence))
    o = grid.from_chunks(jnp.swapaxes(o, 1, 2))
    if not output_final_state:
        return o, None
    if not grid.varlen:
        return o, last.reshape(initial_state.shape)
    final = ends[grid.last_chunks()]  # varlen: B = 1, so ends is [NT, HV, K, V]
    return o, jnp.where(grid.empty_sequences(), initial_state, final)


def kda_recurrent(args):
    """kda through the token-by-token scan, on the call's validated arguments record.

    `chunk_size` only sets the checkpoint segment length of the backward; `disable_recompute` turns
    the checkpoints off. Declines `return_intermediate_states` (`supports`).
    Returns (o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32 (float64 for float64
    inputs) or None).
    """
    empty = result_without_tokens(args, compute_dtype(args.q.dtype))
    if empty is not None:
        return empty
    v, initial_state, cu_seqlens = args.v, args.initial_state, args.cu_seqlens
    prepared = prepare_inputs(args)
    o, final = recurrent_delta_rule(
        prepared.q,
        prepared.k,
        prepared.v,
        prepared.g,
        prepared.beta,
        initial_state,
        cu_seqlens,
        args.output_final_state,
        args.chunk_size,
        recompute=not args.disable_recompute,
    )
    return o.astype(v.dtype), final


INTERMEDIATE_STATES_REASON = (
    "return_intermediate_states=True: the per-chunk states are returned by the chunked implementations "
    "(impl='xla' or 'reference')"
)


def supports(call) -> str | None:
    """Every call except FLA's `return_intermediate_states` (its segments are not FLA's chunks)."""
    if call.option("return_intermediate_states", False):
        return INTERMEDIATE_STATES_REASON
    return None
