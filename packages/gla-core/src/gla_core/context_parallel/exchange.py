"""Carrying states across shards: each device learns the state entering its shard.

Two exchanges, same result:

- "all_gather" (default): every device all-gathers every shard's (leaving map, leaving state) and
  folds the prefix itself in float32. One collective, no device waits on another's fold; the last
  fold step is the fixed-length final state, so it needs no second collective. Each device
  receives (P - 1) shards' maps and states.
- "ring": P - 1 `ppermute` steps, shard j handing its true leaving state to shard j + 1 after it
  has received its own. Only states travel (no maps), each device sends and receives one, but the
  steps are serialized (latency grows with P).

The backward pass is JAX's transpose of the same collectives (all-gather -> reduce-scatter,
ppermute -> the reverse ppermute), so the state gradient flows from later shards to earlier ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gla_core.context_parallel.axis import ContextAxis
from gla_core.context_parallel.layout import ShardLayout
from gla_core.context_parallel.transition import ShardTransition

EXCHANGES = ("all_gather", "ring")
DEFAULT_EXCHANGE = "all_gather"


def carry_states(
    axis: ContextAxis, layout: ShardLayout, transition: ShardTransition, exchange: str
) -> tuple[jax.Array, jax.Array | None]:
    """The state entering this shard, per row, and (all_gather only) the state leaving the last one.

    Returns:
      `(carried, chain_end)`: carried [B, HV, K, V] float32, zero for rows without an entering
      sequence; chain_end [B, HV, K, V], the leaving state of the last shard (the same on every
      device), or None for "ring".
    """
    leaving_state = transition.final[layout.leaving]
    if axis.size == 1:
        return jnp.zeros_like(leaving_state), leaving_state
    if exchange == "ring":
        return _ring(axis, layout, transition, leaving_state), None
    return _all_gather(axis, layout, transition, leaving_state)


def _restarting(layout: ShardLayout, shard) -> jax.Array:
    return layout.restarts[shard][:, None, None, None]


def _all_gather(axis, layout, transition, leaving_state):
    maps = jax.lax.all_gather(transition.leaving_map, axis.name)  # [P, B, ...]
    states = jax.lax.all_gather(leaving_state, axis.name)
    state = states[0]  # shard 0's leaving sequence always starts there
    entering = [jnp.zeros_like(state), state]
    for shard in range(1, axis.size):
        state = jnp.where(
            _restarting(layout, shard), states[shard], transition.apply(maps[shard], state) + states[shard]
        )
        entering.append(state)
    carried = jnp.stack(entering[: axis.size])[axis.index]
    return jnp.where(layout.incoming[:, None, None, None], carried, 0.0), state


def _ring(axis, layout, transition, leaving_state):
    received = None
    for step in range(axis.size - 1):
        if step == 0:  # shard 0's leaving sequence always starts there
            sent = leaving_state
        else:
            true_state = transition.apply(transition.leaving_map, received) + leaving_state
            sent = jnp.where(_restarting(layout, axis.index), leaving_state, true_state)
        got = jax.lax.ppermute(sent, axis.name, perm=[(step, step + 1)])
        received = got if received is None else received + got  # only shard step + 1 gets a nonzero one
    return jnp.where(layout.incoming[:, None, None, None], received, 0.0)


def exchanged_elements(
    exchange: str, devices: int, rows: int, heads: int, key_dim: int, value_dim: int, map_elements: int
) -> int:
    """Elements one device receives in the forward exchange, by formula (float32: 4 bytes each).

    "all_gather": (P - 1) shards' leaving states and maps, (P - 1) * rows * heads * (K * V + m);
    "ring": one leaving state, rows * heads * K * V (each of the P - 1 steps moves one state, from
    one device to the next). The backward pass moves as much again (reduce-scatter / reverse
    ppermutes). Not counted: the sum of the final states over the axis when they are requested
    and not all in the fold (packed input, or "ring"): an all-reduce of N * heads * K * V.

    Args:
      exchange: "all_gather" or "ring".
      devices: P.
      rows: B (fixed length) or 1 (packed).
      heads: HV.
      key_dim, value_dim: K, V.
      map_elements: elements of one head's transition: K * K (dense), K (gla), 1 (simple_gla).
    """
    state = rows * heads * key_dim * value_dim
    if exchange == "ring":
        return state if devices > 1 else 0
    return (devices - 1) * (state + rows * heads * map_elements)
