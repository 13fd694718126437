"""From the op's arguments to a chunked core and back.

A core is `core(q, k, v, g, initial, segments) -> (o, final)` on the `[Bp, NT, C, H, X]` layout
of `gla_simple.layout`, with its own `custom_vjp`. This module does what is common to every
core and left to JAX's autodiff: casting to the compute dtype (float32; float64 for float64
inputs), applying the scale (once, to q), combining the gates and clamping them at
`numerics.LOG_DECAY_FLOOR` (a -inf gate is a hard reset), the chunk layout (padding or varlen
re-layout), and casting `o` to v's dtype. The gradients of these steps (the reduction of dg over
steps into d g_gamma, the varlen gathers, the zero gradient of a clamped -inf gate) follow by
autodiff.

`initial` reaches the core as None when the call has no initial state: a zero state that XLA
can see as a constant must not meet a dot (see `gla_simple.chunked`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from gla_simple.layout import chunk_sequences
from gla_simple.non_finite import NonFinite
from gla_simple.numerics import compute_dtype, floor_log_decays

Core = Callable[..., tuple[jax.Array, jax.Array]]


def gate_of(args) -> jax.Array:
    """The per-step log decay of a simple_gla or gla call: simple_gla's g + g_gamma as [B, T, H, 1]
    (zeros without either), gla's gk [B, T, H, K]."""
    if hasattr(args, "gk"):
        return args.gk
    return simple_gla_gate(args.q, args.g, args.g_gamma)


def simple_gla_gate(q: jax.Array, g: jax.Array | None, g_gamma: jax.Array | None) -> jax.Array:
    """The per-step scalar log decay [B, T, H, 1] in the compute dtype: g + g_gamma (either may be
    None; zeros if both are)."""
    batch, seq_len, heads = q.shape[:3]
    dtype = compute_dtype(q.dtype)
    gate = jnp.zeros((batch, seq_len, heads), dtype)
    if g is not None:
        gate = gate + g.astype(dtype)
    if g_gamma is not None:
        gate = gate + g_gamma.astype(dtype)
    return gate[..., None]


def run(core: Core, args, *, chunk_size: int | None = None, causal_non_finite: bool = True):
    """Runs `core` on a simple_gla or gla call.

    Args:
      core: the chunked core (see the module doc).
      args: the op's validated arguments (`gla_core` arguments record): q, k [B, T, H, K], v
        [B, T, H, V], the gates, scale, initial_state [N, H, K, V] or None, output_final_state,
        cu_seqlens [N+1] int32 (B == 1) or None, chunk_size.
      chunk_size: C of the chunk layout when it differs from the call's.
      causal_non_finite: run the core on finite stand-ins of v and the gates and mark the outputs
        their non-finite values reach (`gla_simple.non_finite`); a core that never multiplies a
        future step by 0 (the recurrence) does not need it.

    Returns:
      o [B, T, H, V] in v's dtype, and the final state [N, H, K, V] (float32; float64 for
      float64 inputs) or None.
    """
    q, k, v, gate = args.q, args.k, args.v, gate_of(args)
    scale, initial_state, cu_seqlens = args.scale, args.initial_state, args.cu_seqlens
    output_final_state = args.output_final_state
    chunk_size = args.chunk_size if chunk_size is None else chunk_size
    batch, seq_len, heads, key_dim = q.shape
    value_dim, out_dtype = v.shape[-1], v.dtype
    dtype = compute_dtype(q.dtype)
    num_sequences = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    initial = None if initial_state is None else initial_state.astype(dtype)
    if batch == 0:  # nothing to compute: the final states are the (empty) initial states
        final = jnp.zeros((0, heads, key_dim, value_dim), dtype) if initial is None else initial
        return jnp.zeros(v.shape, v.dtype), (final if output_final_state else None)
    sequences = chunk_sequences(batch, seq_len, chunk_size, cu_seqlens)
    segments = sequences.segments()
    v = sequences.split(v.astype(dtype))
    gate = sequences.split(floor_log_decays(gate.astype(dtype)))
    non_finite = NonFinite.find(v, gate) if causal_non_finite else None
    if non_finite is not None:
        v, gate = NonFinite.finite(v), NonFinite.finite(gate)
    o, final = core(
        sequences.split(q.astype(dtype) * scale),
        sequences.split(k.astype(dtype)),
        v,
        gate,
        initial,
        segments,
        (num_sequences, heads, key_dim, value_dim),
    )
    if non_finite is not None:
        o, final = non_finite.mark(o, final, segments)
    o = sequences.merge(o).astype(out_dtype)
    return o, (final if output_final_state else None)
