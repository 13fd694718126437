"""Pieces of the kernels that take all n chunks of a grid step at once (a leading chunk axis).

Blocks arrive as `[n*C, D]` time rows or `[n, ...]` per-chunk blocks (`[...]` alone when n = 1,
see `ChunkSpecs`); the helpers here read them as `[n, C, D]` values, write `[n, ...]` values back,
and run the only part of a step that stays sequential, the chain of carried states, as
elementwise updates once every chunk's matmul is done.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gla_core.chunk.common import BATCHED_NN, dot
from gla_core.tpu import NUM_LANES


def chunk_rows(ref, chunks: int, dtype=None) -> jax.Array:
    """A `[n*C, D]` time block as `[n, C, D]` (cast to `dtype` if given)."""
    rows, width = ref.shape
    value = ref[...] if dtype is None else ref[...].astype(dtype)
    return value.reshape(chunks, rows // chunks, width)


def store_chunk_rows(ref, value: jax.Array) -> None:
    """Writes `[n, C, D]` into a `[n*C, D]` time block (cast to the ref's dtype)."""
    chunks, rows, width = value.shape
    ref[...] = value.reshape(chunks * rows, width).astype(ref.dtype)


def gate_rows(ref, rows: int, keys: int) -> jax.Array:
    """A grid step's per-key log decays `[n*C, K]` (`rows` = n*C, `keys` = K): a per-key gate's
    block as it is; a scalar gate's block of "broadcast" mode, `[n*C / 128, 128]` (128 steps per
    row), turned into columns and broadcast over the keys (a 128 x 128 transpose per row)."""
    value = ref[...]
    if value.shape == (rows, keys):
        return value
    columns = [jnp.transpose(jnp.broadcast_to(value[r : r + 1], (NUM_LANES, NUM_LANES))) for r in range(value.shape[0])]
    steps = jnp.concatenate(columns, axis=0) if len(columns) > 1 else columns[0]  # [n*C, 128]: step t in row t
    return steps if keys == NUM_LANES else jnp.concatenate([steps] * (keys // NUM_LANES), axis=1)


def store_gate_rows(ref, grad: jax.Array) -> None:
    """Writes the gradient of the per-key log decays `[n, C, K]` into a per-key gate's `[n*C, K]`
    block, or its sum over the keys into a scalar gate's "broadcast" block `[n*C / 128, 128]`."""
    chunks, rows, keys = grad.shape
    grad = grad.reshape(chunks * rows, keys)
    if ref.shape == grad.shape:
        ref[...] = grad.astype(ref.dtype)
        return
    folded = grad[:, :NUM_LANES]
    for tile in range(1, keys // NUM_LANES):
        folded = folded + grad[:, tile * NUM_LANES : (tile + 1) * NUM_LANES]
    sums = [  # the transposed 128 steps of a row: one key per sublane, summed
        jnp.sum(jnp.transpose(folded[r * NUM_LANES : (r + 1) * NUM_LANES]), axis=0, keepdims=True)
        for r in range(ref.shape[0])
    ]
    ref[...] = (jnp.concatenate(sums, axis=0) if len(sums) > 1 else sums[0]).astype(ref.dtype)


def store_per_chunk(ref, value: jax.Array) -> None:
    """Writes `[n, ...]` into a per-chunk block (`[n, ...]`, or `[...]` when n = 1)."""
    ref[...] = value.reshape(ref.shape).astype(ref.dtype)


def load_per_chunk(ref, chunks: int) -> jax.Array:
    """A per-chunk block as `[n, ...]`."""
    value = ref[...]
    return value if chunks > 1 else value[None]


def causal_mask(chunks: int, chunk: int, strict: bool = False) -> jax.Array:
    """`[n, C, C]` bool: t >= s (t > s when `strict`), t the row and s the column."""
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunks, chunk, chunk), 1)
    cols = jax.lax.broadcasted_iota(jnp.int32, (chunks, chunk, chunk), 2)
    return rows > cols if strict else rows >= cols


def state_chain(start: jax.Array, decays: jax.Array, updates: jax.Array, reverse: bool = False, edges=None):
    """The carried states through the chunks of a step: `S <- S * decays[i] + updates[i]`.

    Args:
      start: `[G, Vt, K]` float32, the state entering the step of each of G groups (heads).
      decays: `[G*n, 1, K]` per-key decay of each chunk; updates: `[G*n, Vt, K]` float32 (group g's
        n chunks are rows g*n .. g*n + n - 1).
      reverse: walk each group's chunks from the last to the first (state gradients).
      edges: packed sequences starting and ending inside the step (`packed.ChainEdges`, one group):
        a chunk that starts one sees its initial state, one that ends one emits its state after the
        update; None (fixed length) for a chain without edges.

    Returns:
      (`[G*n, Vt, K]` the state each chunk sees before its own update, in chunk order; `[G, Vt, K]`
      the state leaving the step).
    """
    groups = start.shape[0]
    chunks = updates.shape[0] // groups
    decays = decays.reshape(groups, chunks, *decays.shape[1:])
    updates = updates.reshape(groups, chunks, *updates.shape[1:])
    seen = [None] * chunks
    state = start
    for i in reversed(range(chunks)) if reverse else range(chunks):
        if edges is not None:
            state = edges.restart(i, state)
        seen[i] = state
        state = state * decays[:, i] + updates[:, i]
        if edges is not None:
            edges.emit(i, state)
    return jnp.stack(seen, axis=1).reshape(groups * chunks, *start.shape[1:]), state


def causal_dot(scores: jax.Array, x: jax.Array, dtype) -> jax.Array:
    """`scores @ x` per chunk for causal `scores` [M, C, C] (zero for s > t) and `x` [M, C, N],
    float32, where row t sees `x_s` only for s <= t even when `x_s` is not finite (as
    `common.causal_dot`): `x` with its non-finite entries zeroed, and every row at or after a step
    holding one NaN."""
    chunks, chunk = scores.shape[:2]
    finite = jnp.isfinite(x.astype(jnp.float32))
    product = dot(scores, jnp.where(finite, x, jnp.zeros((), x.dtype)), BATCHED_NN, dtype)
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunks, chunk, chunk), 1)
    cols = jax.lax.broadcasted_iota(jnp.int32, (chunks, chunk, chunk), 2)
    bad = jnp.max(jnp.where(finite, 0.0, 1.0), axis=2, keepdims=True)  # [M, C, 1]: step s holds one
    bad_row = jnp.sum(jnp.where(rows == cols, bad, 0.0), axis=1, keepdims=True)  # [M, 1, C]
    reached = jnp.max(jnp.where(rows >= cols, bad_row, 0.0), axis=2, keepdims=True)  # [M, C, 1]
    return jnp.where(reached > 0.0, jnp.nan, product)
