"""FLA-named entry point of gla-fused: `fused_chunk_simple_gla`.

It calls `gla_core.dispatch` with the first implementation of its family that accepts the
call, in this order:

- `fused_chunk`: any simple_gla gate, fixed length or packed varlen (one kernel forward, one
  backward, on the op's own layout);
- `fused_g_gamma`: the call's only gate is `g_gamma` (when fused_chunk declines, which it does
  for the same calls: in practice reached with `impl="fused_g_gamma"`);
- `chunk`, then `xla`: what `chunk_simple_gla` uses, for the calls the fused kernels decline
  and off TPU, where Pallas kernels run only in TPU interpret mode
  when asked for (`gla_core.use(interpret=True)` or `GLA_INTERPRET=1`).

The choice depends only on the backend, the interpret setting and the call's static facts,
never on values; `gla_core.explain` gives every implementation's reason.
"""

from __future__ import annotations

import jax

from gla_core.kit import DEFAULT_CHUNK_SIZE, dispatch_by_name

# `fused_chunk_simple_gla` runs the first of these (by priority) that accepts the call.
FAMILY = ("fused_chunk", "fused_g_gamma", "chunk", "xla")


def fused_chunk_simple_gla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array | None = None,
    g_gamma: jax.Array | None = None,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: jax.Array | None = None,
    *,
    context_axis: str | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    state_v_first: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Simple gated linear attention on the fused chunk kernels.

    Per head: S_t = exp(g_t + g_gamma) S_{t-1} + k_t v_tᵀ and o_t = scale · q_tᵀ S_t. Arguments
    and results are those of `gla_simple.chunk_simple_gla`:

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V].
      g: [B, T, H] per-step log decays, or None; g_gamma: [H] per-head log decay, or None.
      scale: multiplies q·k; default K ** -0.5.
      initial_state: [N, H, K, V] or None; output_final_state: also return the final state.
      cu_seqlens: [N+1] int32 packed sequence boundaries (B must be 1), or None.
      chunk_size: 16, 32, 64 or 128 (gla's extra, keyword-only).
      state_v_first: the states are [N, H, V, K] (gla's extra; FLA's fused_chunk has no such argument).
      context_axis: the mesh axis T is sharded over, inside `jax.shard_map` (context parallelism, see
        `gla_core.context_parallel`); None: this device holds whole sequences.

    Returns:
      `(o [B, T, H, V] in v's dtype, final_state [N, H, K, V] float32 or None)`.

    Implementation: see the module doc (`fused_chunk`, `fused_g_gamma`, then `chunk`, `xla`).

    Example:
      >>> q = k = v = jnp.ones((1, 128, 2, 64))
      >>> o, ht = fused_chunk_simple_gla(q, k, v, g_gamma=jnp.full((2,), -0.1), output_final_state=True)
      >>> o.shape, ht.shape
      ((1, 128, 2, 64), (1, 2, 64, 64))
    """
    return dispatch_by_name("simple_gla", locals(), among=FAMILY)
