"""Context parallelism: one sequence split along T over a mesh axis, inside `jax.shard_map`.

`gla_core.dispatch(op, q, k, v, ..., context_axis="cp")`, called inside a shard_map whose in_specs
shard T over mesh axis "cp", returns this device's slice of o and the final states of the whole
sequences (the same on every device). `dispatch_sharded` does the same for global arrays and sets
up the shard_map itself.

How (design section 8): each op is affine in its state per shard (`gla_core.ops.ContextParallelSpec`).
Each device runs the op on its shard with the implementation dispatch chooses, from zero state for
sequences that come from earlier shards (`layout`); reads off its shard's transition, diagonal from
the gates or dense from K extra value columns (`transition`); exchanges one state per batch row with
the other devices, by one all-gather or a ring of ppermutes, and folds the prefix in float32
(`exchange`); then adds the carried-in state's contribution to its entering sequence's outputs.
Implementations take part through their `initial_state` and final state, so no kernel exists twice;
one that cannot declines through `explain` (`Call.context_axis` marks the per-device call).
Gradients are JAX's transposes of the same collectives and the implementations' own backward.

Composition: batch (B) and heads (H, HV) shard over other mesh axes with no communication (see
`dispatch_sharded`'s `batch_axis` and `head_axis`); packed sequences (`cu_seqlens`, B == 1) give the
global boundaries on every device.
"""

from gla_core.context_parallel.exchange import DEFAULT_EXCHANGE, EXCHANGES
from gla_core.context_parallel.wrapper import dispatch_sharded

__all__ = ["DEFAULT_EXCHANGE", "EXCHANGES", "dispatch_sharded"]
