"""FLA-named entry points: `chunk_simple_gla`, `chunk_gla`, `fused_recurrent_simple_gla`, `fused_recurrent_gla`.

Each calls `gla_core.dispatch` with a fixed implementation family:

- `chunk_*` run the chunked family. They use the Pallas TPU implementation `chunk` when it
  accepts the call — on a TPU backend, or off-TPU in TPU interpret mode when asked for with
  `gla_core.use(interpret=True)` or `GLA_INTERPRET=1` — and the `xla` implementation (plain
  `jnp`, the same chunked algorithm with the same `chunk_size`) otherwise, e.g. on CPU and GPU.
  Both compute the same op; results agree up to float rounding. The choice depends only on the
  backend, the interpret setting and the call's shapes, never on the values.
- `fused_recurrent_*` always use the `recurrent` implementation (a `lax.scan` over time, the
  decode path).

Dispatch overrides (`impl=`, `gla_core.use(simple_gla=...)`, `GLA_IMPL_<OP>`) choose among every
implementation; these functions pin their family instead (`dispatch(..., among=CHUNK_FAMILY)`).
Call `gla_core.dispatch` directly to let overrides or priorities decide: on a TPU, dispatch picks
the fused implementations of gla-fused for simple_gla (higher priority), while `chunk_simple_gla`
stays on FLA's chunk algorithm (`fused_chunk_simple_gla` of gla-fused is the fused family).
"""

from __future__ import annotations

import jax

from gla_core.kit import dispatch_by_name

CHUNK_FAMILY = ("chunk", "xla")  # `chunk_*`: the Pallas chunk kernels when they accept, else the same algorithm in XLA
RECURRENT = "recurrent"


def chunk_simple_gla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array | None = None,
    g_gamma: jax.Array | None = None,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: jax.Array | None = None,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array | None]:
    """Simple gated linear attention (scalar decay per head and step), chunked.

    Per head: S_t = exp(g_t + g_gamma) S_{t-1} + k_t v_tᵀ and o_t = scale · q_tᵀ S_t.

    Args:
      q: [B, T, H, K] queries.
      k: [B, T, H, K] keys.
      v: [B, T, H, V] values.
      g: [B, T, H] per-step log decays (<= 0), or None.
      g_gamma: [H] constant per-head log decay, or None; with `g`, the decay is g + g_gamma.
        Neither: no decay (plain linear attention).
      scale: multiplies q·k; default K ** -0.5.
      initial_state: [N, H, K, V] state before the first token (N = B, or the number of
        sequences with `cu_seqlens`); default zeros.
      output_final_state: also return the state after the last token.
      cu_seqlens: [N+1] int32 boundaries of packed sequences (B must be 1); may be traced
        under `jax.jit`.
      chunk_size: 16, 32, 64 or 128 tokens per chunk.

    Returns:
      `(o, final_state)`: o [B, T, H, V] in v's dtype; final_state [N, H, K, V] float32, or None
      unless `output_final_state`.

    Implementation: `chunk` (Pallas TPU) when it accepts the call, else `xla` (see the module doc).

    Example:
      >>> q = k = jnp.ones((1, 128, 4, 64)); v = jnp.ones((1, 128, 4, 64))
      >>> g = jnp.full((1, 128, 4), -0.1)
      >>> o, ht = chunk_simple_gla(q, k, v, g=g, output_final_state=True)
      >>> o.shape, ht.shape
      ((1, 128, 4, 64), (1, 4, 64, 64))
    """
    return dispatch_by_name("simple_gla", locals(), among=CHUNK_FAMILY)


def chunk_gla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: jax.Array | None = None,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array | None]:
    """Gated linear attention with a per-key decay, chunked.

    Per head: S_t = diag(exp(g_t)) S_{t-1} + k_t v_tᵀ and o_t = scale · q_tᵀ S_t.

    Args:
      q: [B, T, H, K] queries.
      k: [B, T, H, K] keys.
      v: [B, T, H, V] values.
      g: [B, T, H, K] per-step, per-key log decays (<= 0) — FLA's `chunk_gla` name for the op's `gk`.
      scale: multiplies q·k; default K ** -0.5.
      initial_state: [N, H, K, V] state before the first token; default zeros.
      output_final_state: also return the state after the last token.
      cu_seqlens: [N+1] int32 boundaries of packed sequences (B must be 1); may be traced.
      chunk_size: 16, 32, 64 or 128 tokens per chunk.

    Returns:
      `(o, final_state)`: o [B, T, H, V] in v's dtype; final_state [N, H, K, V] float32 or None.

    Implementation: `chunk` (Pallas TPU) when it accepts the call, else `xla` (see the module doc).

    Example:
      >>> q = k = jnp.ones((1, 128, 4, 64)); v = jnp.ones((1, 128, 4, 64))
      >>> g = jnp.full((1, 128, 4, 64), -0.1)
      >>> o, _ = chunk_gla(q, k, v, g)
      >>> o.shape
      (1, 128, 4, 64)
    """
    arguments = dict(locals(), gk=g)
    del arguments["g"]
    return dispatch_by_name("gla", arguments, among=CHUNK_FAMILY)


def fused_recurrent_simple_gla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array | None = None,
    g_gamma: jax.Array | None = None,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Simple gated linear attention by the token-by-token recurrence (the decode path).

    Same arguments and results as `chunk_simple_gla` (without `chunk_size`); always runs the
    `recurrent` implementation, a `lax.scan` over time.

    Example (one decode step carrying the state):
      >>> q = k = v = jnp.ones((1, 1, 4, 64)); h = jnp.zeros((1, 4, 64, 64))
      >>> o, h = fused_recurrent_simple_gla(q, k, v, g_gamma=jnp.full((4,), -0.1),
      ...                                   initial_state=h, output_final_state=True)
      >>> o.shape, h.shape
      ((1, 1, 4, 64), (1, 4, 64, 64))
    """
    return dispatch_by_name("simple_gla", locals(), impl=RECURRENT)


def fused_recurrent_gla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    gk: jax.Array | None = None,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Gated linear attention with a per-key decay by the token-by-token recurrence (the decode path).

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V].
      gk: [B, T, H, K] per-key log decays, or None for no decay (as in FLA; the call then runs
        op simple_gla without a gate, which is the same recurrence).
      scale, initial_state, output_final_state, cu_seqlens: as in `chunk_gla`.

    Returns:
      `(o, final_state)`: o [B, T, H, V] in v's dtype; final_state [N, H, K, V] float32 or None.

    Example:
      >>> q = k = v = jnp.ones((1, 16, 2, 32)); gk = jnp.full((1, 16, 2, 32), -0.05)
      >>> o, ht = fused_recurrent_gla(q, k, v, gk=gk, output_final_state=True)
      >>> o.shape, ht.shape
      ((1, 16, 2, 32), (1, 2, 32, 32))
    """
    arguments = dict(locals())
    if gk is None:  # no decay: the simple_gla recurrence without a gate
        del arguments["gk"]
        return dispatch_by_name("simple_gla", arguments, impl=RECURRENT)
    return dispatch_by_name("gla", arguments, impl=RECURRENT)
