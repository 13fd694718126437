"""Where the sequences of a T-sharded batch lie relative to each shard.

Fixed-length input is B sequences that each span every shard. Packed input (`cu_seqlens`, B == 1)
is N sequences with global boundaries: a sequence may lie inside one shard, span several, start
exactly at a shard boundary or be empty. Either way, at each shard boundary at most one sequence
per batch row is cut, so one state per row travels from shard to shard: the state of the sequence
holding the shard's last token ("leaving" the shard), which is the sequence "entering" the next
shard when it continues there. Every quantity here is computed on every device from the global
boundaries (small int32 arrays), so no device waits for another to learn them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gla_core.context_parallel.axis import ContextAxis


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """The sequences of this device's shard and how states flow between shards.

    Attributes:
      local_cu_seqlens: [N+1] int32 boundaries clipped to this shard (None for fixed length):
        the local call's `cu_seqlens` (sequences outside the shard become empty).
      h0_here: [N] bool, sequences whose initial state enters on this shard (their first token
        lies here; an empty sequence: its position, the last shard for position T).
      leaving: [B] int32, per row the sequence holding this shard's last token.
      leaving_tokens: [B, T] bool, that sequence's tokens on this shard.
      restarts: [P, B] bool, per shard and row: the leaving sequence starts in that shard, so its
        state there does not depend on earlier shards.
      entering: [B] int32, per row the sequence continuing into this shard from the previous one.
      incoming: [B] bool, per row: there is such a sequence (False on shard 0, or when a
        sequence boundary falls exactly on this shard's first token).
      entering_tokens: [B, T] bool, its tokens on this shard (all False without one).
      ends_here: [N] bool, sequences whose last token (an empty sequence: its position) lies here:
        their final state is computed on this shard.
    """

    local_cu_seqlens: jax.Array | None
    h0_here: jax.Array
    leaving: jax.Array
    leaving_tokens: jax.Array
    restarts: jax.Array
    entering: jax.Array
    incoming: jax.Array
    entering_tokens: jax.Array
    ends_here: jax.Array


def shard_layout(cu_seqlens: jax.Array | None, batch: int, shard_len: int, axis: ContextAxis) -> ShardLayout:
    """The layout of this device's shard.

    Args:
      cu_seqlens: [N+1] int32 global boundaries (B == 1), or None for B fixed-length sequences.
      batch: B.
      shard_len: T, the tokens per shard (the global length is P * T).
      axis: the context axis (P shards, this device's index).
    """
    if cu_seqlens is None:
        return _fixed_layout(batch, shard_len, axis)
    return _packed_layout(cu_seqlens, shard_len, axis)


def _fixed_layout(batch: int, shard_len: int, axis: ContextAxis) -> ShardLayout:
    first, last = axis.index == 0, axis.index == axis.size - 1
    rows = jnp.arange(batch, dtype=jnp.int32)
    incoming = jnp.broadcast_to(~first, (batch,))
    return ShardLayout(
        local_cu_seqlens=None,
        h0_here=jnp.broadcast_to(first, (batch,)),
        leaving=rows,
        leaving_tokens=jnp.ones((batch, shard_len), bool),
        restarts=jnp.broadcast_to((jnp.arange(axis.size) == 0)[:, None], (axis.size, batch)),
        entering=rows,
        incoming=incoming,
        entering_tokens=jnp.broadcast_to(incoming[:, None], (batch, shard_len)),
        ends_here=jnp.broadcast_to(last, (batch,)),
    )


def _packed_layout(cu_seqlens: jax.Array, shard_len: int, axis: ContextAxis) -> ShardLayout:
    cu = cu_seqlens.astype(jnp.int32)
    num_sequences = cu.shape[0] - 1
    first_token = axis.index * shard_len
    local_cu = jnp.clip(cu - first_token, 0, shard_len)
    home = jnp.minimum(cu[:-1] // shard_len, axis.size - 1)  # the shard of each sequence's start

    def holder(position):  # the (non-empty) sequence holding global token `position`
        return jnp.clip(jnp.searchsorted(cu, position, side="right") - 1, 0, num_sequences - 1).astype(jnp.int32)

    shard_starts = jnp.arange(axis.size, dtype=jnp.int32) * shard_len
    leaving_all = holder(shard_starts + shard_len - 1)  # [P]
    leaving = leaving_all[axis.index]
    entering = leaving_all[jnp.maximum(axis.index - 1, 0)]
    incoming = (axis.index > 0) & (cu[entering + 1] > first_token)
    tokens = jnp.arange(shard_len, dtype=jnp.int32)
    nonempty = cu[1:] > cu[:-1]
    end_shard = jnp.where(nonempty, (cu[1:] - 1) // shard_len, home)
    return ShardLayout(
        local_cu_seqlens=local_cu,
        h0_here=home == axis.index,
        leaving=leaving[None],
        leaving_tokens=(tokens >= local_cu[leaving])[None],
        restarts=(cu[leaving_all] >= shard_starts)[:, None],
        entering=entering[None],
        incoming=incoming[None],
        entering_tokens=(incoming & (tokens < local_cu[entering + 1]))[None],
        ends_here=end_shard == axis.index,
    )
