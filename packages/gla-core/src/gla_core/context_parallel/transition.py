"""What one shard does to a carried-in state, read off the implementation's own run.

Every op here is affine in its state, one value column at a time, with a transition independent of
v: started from S0, a sequence's states are `S_t = M_t S0 + C_t` and its outputs
`o_t = o_t|S0=0 + (scale q̂_tᵀ M_t) S0`. A device runs the op on its shard (state zero for
sequences that come from an earlier shard) and corrects the tokens of the entering sequence once
the carried-in state S0 is known. Two ways to get `M_t` and the "query" `scale q̂_tᵀ M_t`:

- diagonal (simple_gla, gla): `M_t = diag(exp(G_t))`, G_t the cumulative log decay from the
  shard's first token: computed from the gates directly (`ContextParallelSpec.log_decay`).
- dense (kda): the run gets K extra value columns, zero values and an identity initial state: those
  columns' final state is M and their outputs are the query. Exact, whatever the op does to q, k,
  gates and beta inside its kernel, at the price of V + K value columns instead of V.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gla_core.context_parallel.layout import ShardLayout

# float32 products on every backend: at default precision a TPU rounds float32 matmul operands to
# bfloat16 (XLA then even gathers the transitions in bfloat16), and carried states touch every token.
FLOAT32 = dict(preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)


@dataclasses.dataclass(frozen=True)
class ShardTransition:
    """This shard's run and its affine maps.

    Attributes:
      o: [B, T, HV, V] the run's output (v's dtype); exact except on the entering sequence's tokens.
      final: [N, HV, K, V] float32, each sequence's state at the end of the shard in the run (for a
        sequence continuing from an earlier shard: C, its part that does not depend on S0).
      leaving_map, entering_map: the transition M over this shard of each row's leaving and
        entering sequence: [B, HV, K, K] (dense) or its diagonal [B, HV, K or 1] (diagonal).
      query: [B, T, HV, K] float32, `scale q̂_tᵀ M_t` on the entering sequence's tokens, zero
        elsewhere: those tokens' outputs gain `query_t S0`.
      dense: whether the maps are dense.
    """

    o: jax.Array
    final: jax.Array
    leaving_map: jax.Array
    entering_map: jax.Array
    query: jax.Array
    dense: bool

    def apply(self, transition: jax.Array, state: jax.Array) -> jax.Array:
        """`transition @ state` for [B, HV, K, V] states (per row and head)."""
        if self.dense:
            return jnp.einsum("bhij,bhjv->bhiv", transition, state, **FLOAT32)
        return transition[..., None] * state

    def corrected_output(self, carried: jax.Array) -> jax.Array:
        """[B, T, HV, V] outputs with the carried-in states `carried` [B, HV, K, V] added."""
        correction = jnp.einsum("bthk,bhkv->bthv", self.query, carried, **FLOAT32)
        return (self.o.astype(jnp.float32) + correction).astype(self.o.dtype)

    def final_states(self, layout: ShardLayout, carried: jax.Array) -> jax.Array:
        """[N, HV, K, V] true states at the end of this shard (`carried` is zero without an entering
        sequence, so only the entering one changes)."""
        return self.final.at[layout.entering].add(self.apply(self.entering_map, carried))


def augment_for_dense(v: jax.Array, initial_state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(v, initial_state)` with K extra value columns: zero values, identity states.

    Args:
      v: [B, T, HV, V].
      initial_state: [N, HV, K, V] float32.

    Returns:
      `[B, T, HV, V + K]` and `[N, HV, K, V + K]`.
    """
    num_states, heads, key_dim, _ = initial_state.shape
    zeros = jnp.zeros((*v.shape[:3], key_dim), v.dtype)
    identity = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (num_states, heads, key_dim, key_dim))
    return jnp.concatenate([v, zeros], axis=-1), jnp.concatenate([initial_state, identity], axis=-1)


def dense_transition(o: jax.Array, final: jax.Array, value_dim: int, layout: ShardLayout) -> ShardTransition:
    """The transition from a run on augmented inputs (`augment_for_dense`).

    Args:
      o: [B, T, HV, V + K] the run's output.
      final: [N, HV, K, V + K] its final states.
      value_dim: V.
      layout: the shard's layout.
    """
    maps = final[..., value_dim:].astype(jnp.float32)
    query = jnp.where(layout.entering_tokens[:, :, None, None], o[..., value_dim:].astype(jnp.float32), 0.0)
    return ShardTransition(
        o=o[..., :value_dim],
        final=final[..., :value_dim].astype(jnp.float32),
        leaving_map=maps[layout.leaving],
        entering_map=maps[layout.entering],
        query=query,
        dense=True,
    )


def diagonal_transition(
    o: jax.Array, final: jax.Array, q: jax.Array, log_decay: jax.Array, scale: float, layout: ShardLayout
) -> ShardTransition:
    """The transition of an op with a diagonal one, from its gates.

    Args:
      o: [B, T, H, V] the run's output.
      final: [N, H, K, V] its final states.
      q: [B, T, H, K] queries.
      log_decay: [B, T, H, K or 1] float32 per-token log decay (<= 0, may be -inf).
      scale: the op's query scale.
      layout: the shard's layout.
    """
    entering = layout.entering_tokens[:, :, None, None]
    leaving = layout.leaving_tokens[:, :, None, None]
    # the entering sequence's tokens are a prefix of the shard: its cumulative decay from token 0
    cumulative = jnp.cumsum(jnp.where(entering, log_decay, 0.0), axis=1)
    query = jnp.where(entering, scale * q.astype(jnp.float32) * jnp.exp(cumulative), 0.0)
    return ShardTransition(
        o=o,
        final=final.astype(jnp.float32),
        leaving_map=jnp.exp(jnp.sum(jnp.where(leaving, log_decay, 0.0), axis=1)),
        entering_map=jnp.exp(cumulative[:, -1]),
        query=query,
        dense=False,
    )
