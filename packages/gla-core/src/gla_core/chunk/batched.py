"""Pieces of the kernels that take all n chunks of a grid step at once (a leading chunk axis).

Blocks arrive as `[n*C, D]` time rows or `[n, ...]` per-chunk blocks (`[...]` alone when n = 1,
see `ChunkSpecs`); the helpers here read them as `[n, C, D]` values, write `[n, ...]` values back,
and run the only part of a step that stays sequential, the chain of carried states, as
elementwise updates once every chunk's matmul is done.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def chunk_rows(ref, chunks: int, dtype=None) -> jax.Array:
    """A `[n*C, D]` time block as `[n, C, D]` (cast to `dtype` if given)."""
    rows, width = ref.shape
    value = ref[...] if dtype is None else ref[...].astype(dtype)
    return value.reshape(chunks, rows // chunks, width)


def store_chunk_rows(ref, value: jax.Array) -> None:
    """Writes `[n, C, D]` into a `[n*C, D]` time block (cast to the ref's dtype)."""
    chunks, rows, width = value.shape
    ref[...] = value.reshape(chunks * rows, width).astype(ref.dtype)


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


def state_chain(start: jax.Array, decays: jax.Array, updates: jax.Array, reverse: bool = False):
    """The carried state through the n chunks of a step: `S <- S * decays[i] + updates[i]`.

    Args:
      start: `[Vt, K]` float32, the state entering the step.
      decays: `[n, 1, K]` per-key decay of each chunk; updates: `[n, Vt, K]` float32.
      reverse: walk the chunks from the last to the first (state gradients).

    Returns:
      (`[n, Vt, K]` the state each chunk sees before its own update, in chunk order; the state
      leaving the step).
    """
    chunks = updates.shape[0]
    seen = [None] * chunks
    state = start
    for i in reversed(range(chunks)) if reverse else range(chunks):
        seen[i] = state
        state = state * decays[i] + updates[i]
    return jnp.stack(seen), state
