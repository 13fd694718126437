"""From the op's arguments to a chunked float32 core and back.

A core is `core(q, k, v, g, initial, segments) -> (o, final)` on the `[Bp, NT, C, H, X]` layout
of `gla_simple.layout`, with its own `custom_vjp`. This module does what is common to every
core and left to JAX's autodiff: casting to float32, applying the scale (once, to q), combining
the gates, the chunk layout (padding or varlen re-layout), and casting `o` to v's dtype. The
gradients of these steps (the reduction of dg over steps into d g_gamma, the varlen gathers)
follow by autodiff.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from gla_simple.layout import chunk_sequences

F32 = jnp.float32

# Keyword arguments of the implementations' `fn` that are Python values (static under jax.jit).
STATIC_ARGUMENTS = ("scale", "output_final_state", "chunk_size", "interpret")

Core = Callable[..., tuple[jax.Array, jax.Array]]


def simple_gla_gate(q: jax.Array, g: jax.Array | None, g_gamma: jax.Array | None) -> jax.Array:
    """The per-step scalar log decay [B, T, H, 1]: g + g_gamma (either may be None; zeros if both are)."""
    batch, seq_len, heads = q.shape[:3]
    gate = jnp.zeros((batch, seq_len, heads), F32)
    if g is not None:
        gate = gate + g.astype(F32)
    if g_gamma is not None:
        gate = gate + g_gamma.astype(F32)
    return gate[..., None]


def run(
    core: Core,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    gate: jax.Array,
    *,
    scale: float,
    initial_state: jax.Array | None,
    output_final_state: bool,
    cu_seqlens: jax.Array | None,
    chunk_size: int,
) -> tuple[jax.Array, jax.Array | None]:
    """Runs `core` on the op's arguments.

    Args:
      core: the chunked core (see the module doc).
      q, k: [B, T, H, K]; v: [B, T, H, V].
      gate: [B, T, H, 1] scalar or [B, T, H, K] per-key log decay.
      scale: multiplies q.
      initial_state: [N, H, K, V] or None (zeros).
      output_final_state: return the final state.
      cu_seqlens: [N+1] int32 packed sequence boundaries (B == 1) or None.
      chunk_size: C of the chunk layout.

    Returns:
      o [B, T, H, V] in v's dtype, and the final state [N, H, K, V] float32 or None.
    """
    batch, seq_len, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    sequences = chunk_sequences(batch, seq_len, chunk_size, cu_seqlens)
    num_sequences = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is None:
        initial = jnp.zeros((num_sequences, heads, key_dim, value_dim), F32)
    else:
        initial = initial_state.astype(F32)
    o, final = core(
        sequences.split(q.astype(F32) * scale),
        sequences.split(k.astype(F32)),
        sequences.split(v.astype(F32)),
        sequences.split(gate.astype(F32)),
        initial,
        sequences.segments(),
    )
    o = sequences.merge(o).astype(v.dtype)
    return o, (final if output_final_state else None)
