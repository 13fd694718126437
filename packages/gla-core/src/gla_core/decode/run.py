"""`decode_attention`: the decode step with a state pool, from prepared inputs in the call's layout.

The op-specific prologue (gates, scale, kda's l2norm/gate/beta) is the plugin's; from there every
op runs the same steps: the token grid and the pool slots (`layout`), the prepared tokens on the
grid (`tokens`), the Pallas kernel (`kernel`) or its XLA fallback (`xla`), and the way back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gla_core.decode.kernel import DecodeConfig, decode_pallas, head_block, head_groups
from gla_core.decode.layout import PoolSlots, TokenGrid, max_tokens_of
from gla_core.decode.tokens import DecodeTokens
from gla_core.decode.xla import decode_xla
from gla_core.errors import InvalidArgumentError


def decode_attention(
    q,
    k,
    v,
    g,
    beta,
    *,
    pool,
    ssm_state_indices,
    num_accepted_tokens=None,
    cu_seqlens=None,
    host_boundaries=None,
    v_first: bool = False,
    inplace_final_state: bool = True,
    pallas: bool,
    interpret: bool = False,
):
    """The decode step of simple_gla, gla (beta None) or kda (beta given) with a state pool.

    Args:
      q, k: [B, T, H, K] (q already scaled); v: [B, T, HV, V]; g: [B, T, HV, 1] scalar or
        [B, T, HV, K] per-key log decays; beta: [B, T, HV] delta-rule strength, or None.
      pool: [P, HV, K, V] states ([P, HV, V, K] when `v_first`), any float dtype.
      ssm_state_indices: int32 [N] or [N, S]; num_accepted_tokens: int32 [N] or None.
      cu_seqlens: [N+1] int32 (B == 1) or None; host_boundaries: its values on the host (needed with
        1-D indices and packed sequences).
      v_first, inplace_final_state: as the op's `state_v_first`, `inplace_final_state`.
      pallas: run the Pallas TPU kernel (else the XLA fallback); interpret: TPU interpret mode.

    Returns:
      (o [B, T, HV, V] float32 (float64 for float64 inputs), the updated pool — or, without
      `inplace_final_state`, the state after every token [B, T, HV, K, V] (pool layout and dtype)).
    """
    batch, seq_len = q.shape[:2]
    max_tokens = max_tokens_of(batch, seq_len, ssm_state_indices, host_boundaries)
    grid = TokenGrid.build(batch, seq_len, max_tokens, cu_seqlens)
    tokens = DecodeTokens.build(grid, q, k, v, g, beta)
    slots = PoolSlots.build(ssm_state_indices, num_accepted_tokens, pool.shape[0], grid)
    token_states = not inplace_final_state
    if grid.num_sequences == 0:  # nothing to run
        heads, rows, lanes = pool.shape[1:]
        states = jnp.zeros((batch, seq_len, heads, rows, lanes), pool.dtype)
        return jnp.zeros((*v.shape[:3], v.shape[3]), jnp.float32), states if token_states else pool
    if pallas:
        config = kernel_config(tokens, pool, slots, grid, v_first, token_states, interpret)
        launch = inference_only(lambda tokens, pool, slots: decode_pallas(tokens, pool, slots, grid, config))
        o, out = launch(tokens, pool, slots)
    else:
        o, out = decode_xla(tokens, pool, slots, grid, v_first=v_first, token_states=token_states)
    o = grid.from_grid(o)
    if token_states:
        out = grid.from_grid(out.astype(pool.dtype)).astype(pool.dtype)
    return o, out


def decode_call(args, q, k, v, g, beta, *, pallas: bool):
    """`decode_attention` with the pool arguments of an op's validated arguments record `args`
    (initial_state as the pool, ssm_state_indices, num_accepted_tokens, cu_seqlens, cu_seqlens_cpu,
    state_v_first, inplace_final_state, interpret); q, k, v, g, beta prepared by the op's plugin.

    Returns (o [B, T, HV, V] in args.v's dtype, the updated pool or the state after every token).
    """
    o, states = decode_attention(
        q,
        k,
        v,
        g,
        beta,
        pool=args.initial_state,
        ssm_state_indices=args.ssm_state_indices,
        num_accepted_tokens=args.num_accepted_tokens,
        cu_seqlens=args.cu_seqlens,
        host_boundaries=args.cu_seqlens_cpu,
        v_first=args.state_v_first,
        inplace_final_state=args.inplace_final_state,
        pallas=pallas,
        interpret=args.interpret,
    )
    return o.astype(args.v.dtype), states


def inference_only(fn):
    """`fn`, raising a clear error when differentiated (the Pallas decode kernel has no backward)."""
    guarded = jax.custom_jvp(fn)

    def refuse(primals, tangents):
        raise InvalidArgumentError(
            "impl='decode': the Pallas decode kernel serves inference only (no gradient through a state pool); "
            "differentiate impl='decode_xla' or impl='reference' instead"
        )

    guarded.defjvp(refuse)
    return guarded


def kernel_config(tokens, pool, slots, grid, v_first: bool, token_states: bool, interpret: bool) -> DecodeConfig:
    """The Pallas launch's static facts for one call (the head block from the VMEM budget)."""
    heads, rows, lanes = pool.shape[1:]
    if token_states:
        buffers = 2 * grid.block  # the double-buffered output blocks of the token states
    elif slots.per_token:
        buffers = grid.block  # a write buffer per token
    else:
        buffers = 0 if pool.dtype == jnp.float32 and not v_first else 1  # the state, or a copy in the pool's layout
    hb = head_block(heads, rows * lanes, jnp.dtype(pool.dtype).itemsize, buffers)
    return DecodeConfig(
        scalar_gate=tokens.g.shape[-1] == 1,
        delta_rule=tokens.beta is not None,
        v_first=v_first,
        per_token=slots.per_token,
        token_states=token_states,
        head_block=hb,
        token_block=grid.block,
        head_groups=head_groups(hb),
        interpret=interpret,
    )


__all__ = ["decode_attention", "inference_only", "kernel_config"]
