"""FLA-named entry points: `chunk_simple_gla`, `chunk_gla`, `fused_recurrent_simple_gla`,
`fused_recurrent_gla`, `parallel_simple_gla`.

Each takes FLA's arguments with FLA's names, order and defaults (gla's extras, e.g. `chunk_size`,
come after them, keyword-only) and calls `gla_core.dispatch` with a fixed implementation family:

- `chunk_*` run the chunked family. They use the Pallas TPU implementation `chunk` when it
  accepts the call — on a TPU backend, or off-TPU in TPU interpret mode when asked for with
  `gla_core.use(interpret=True)` or `GLA_INTERPRET=1` — and the `xla` implementation (plain
  `jnp`, the same chunked algorithm with the same `chunk_size`) otherwise, e.g. on CPU and GPU.
  Both compute the same op; results agree up to float rounding. The choice depends only on the
  backend, the interpret setting and the call's shapes, never on the values.
- `fused_recurrent_*` use the `recurrent` implementation (a `lax.scan` over time); with a state
  pool (`ssm_state_indices`, the serving decode path) the decode family: the Pallas `decode` kernel
  where it accepts the call, else `decode_xla`.
- `parallel_simple_gla` computes `o` with the chunked family (the same function as FLA's parallel
  form) and, with `output_attentions`, the attention matrix (`gla_simple.parallel`).

Dispatch overrides (`impl=`, `gla_core.use(simple_gla=...)`, `GLA_IMPL_<OP>`) choose among every
implementation; these functions pin their family instead (`dispatch(..., among=CHUNK_FAMILY)`).
Call `gla_core.dispatch` directly to let overrides or priorities decide: on a TPU, dispatch picks
the fused implementations of gla-fused for simple_gla (higher priority), while `chunk_simple_gla`
stays on FLA's chunk algorithm (`fused_chunk_simple_gla` of gla-fused is the fused family).

FLA's arguments that have no meaning in JAX are rejected by name when set: `cu_seqlens_cpu` is
checked against `cu_seqlens` (gla needs no host copy), `reverse=True` is served (the recurrence on
every sequence read backwards), `gv` (a per-value decay) is not supported.
"""

from __future__ import annotations

import jax

from gla_core.errors import InvalidArgumentError, describe
from gla_core.kit import DEFAULT_CHUNK_SIZE, decode, dispatch_by_name, state_v_first_of
from gla_simple.parallel import attention_matrix
from gla_simple.reverse import reverse_time, reversed_tokens

CHUNK_FAMILY = ("chunk", "xla")  # `chunk_*`: the Pallas chunk kernels when they accept, else the same algorithm in XLA
RECURRENT = "recurrent"
DECODE_FAMILY = decode.registration.FAMILY  # fused_recurrent_* with a state pool: ("decode", "decode_xla")


def chunk_simple_gla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array | None = None,
    g_gamma: jax.Array | None = None,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: jax.Array | None = None,
    cu_seqlens_cpu=None,
    *,
    context_axis: str | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    transpose_state_layout: bool | None = None,
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
        sequences with `cu_seqlens`); default zeros. [N, H, V, K] with `state_v_first`.
      output_final_state: also return the state after the last token.
      state_v_first: the states (initial and final) are [N, H, V, K] (FLA's V-first layout).
      cu_seqlens: [N+1] int32 boundaries of packed sequences (B must be 1); may be traced
        under `jax.jit`.
      cu_seqlens_cpu: FLA's host copy of `cu_seqlens` (list or numpy array), checked against it;
        gla needs none (traced boundaries cost no host sync).
      chunk_size: 16, 32, 64 or 128 tokens per chunk.
      transpose_state_layout: FLA's deprecated name of `state_v_first`.
      context_axis: the mesh axis T is sharded over, inside `jax.shard_map` (context parallelism, see
        `gla_core.context_parallel`); None: this device holds whole sequences.

    Returns:
      `(o, final_state)`: o [B, T, H, V] in v's dtype; final_state [N, H, K, V] (or [N, H, V, K])
      float32, or None unless `output_final_state`.

    Implementation: `chunk` (Pallas TPU) when it accepts the call, else `xla` (see the module doc).

    Example:
      >>> q = k = jnp.ones((1, 128, 4, 64)); v = jnp.ones((1, 128, 4, 64))
      >>> g = jnp.full((1, 128, 4), -0.1)
      >>> o, ht = chunk_simple_gla(q, k, v, g=g, output_final_state=True)
      >>> o.shape, ht.shape
      ((1, 128, 4, 64), (1, 4, 64, 64))
    """
    arguments = dict(locals(), state_v_first=state_v_first_of(state_v_first, transpose_state_layout))
    del arguments["transpose_state_layout"]
    return dispatch_by_name("simple_gla", arguments, among=CHUNK_FAMILY)


def chunk_gla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: jax.Array | None = None,
    cu_seqlens_cpu=None,
    *,
    context_axis: str | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[jax.Array, jax.Array | None]:
    """Gated linear attention with a per-key decay, chunked.

    Per head: S_t = diag(exp(g_t)) S_{t-1} + k_t v_tᵀ and o_t = scale · q_tᵀ S_t.

    Args:
      q: [B, T, H, K] queries.
      k: [B, T, H, K] keys.
      v: [B, T, H, V] values.
      g: [B, T, H, K] per-step, per-key log decays (<= 0) — FLA's `chunk_gla` name for the op's `gk`.
      scale: multiplies q·k; default K ** -0.5.
      initial_state: [N, H, K, V] state before the first token ([N, H, V, K] with `state_v_first`);
        default zeros.
      output_final_state: also return the state after the last token.
      state_v_first: the states are [N, H, V, K] (FLA's V-first layout).
      cu_seqlens: [N+1] int32 boundaries of packed sequences (B must be 1); may be traced.
      cu_seqlens_cpu: FLA's host copy of `cu_seqlens`, checked against it.
      chunk_size: 16, 32, 64 or 128 tokens per chunk.
      context_axis: the mesh axis T is sharded over, inside `jax.shard_map` (context parallelism, see
        `gla_core.context_parallel`); None: this device holds whole sequences.

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


def _recurrent(op: str, arguments: dict, reverse: bool, transpose_state_layout):
    """Runs `fused_recurrent_*`: the recurrence, or the decode family with a state pool; `reverse`
    reads every sequence backwards (`gla_simple.reverse`)."""
    arguments = dict(arguments, state_v_first=state_v_first_of(arguments["state_v_first"], transpose_state_layout))
    how = {"impl": RECURRENT} if arguments["ssm_state_indices"] is None else {"among": DECODE_FAMILY}
    if not reverse:
        return dispatch_by_name(op, arguments, **how)
    if arguments["ssm_state_indices"] is not None:
        raise InvalidArgumentError("reverse: the decode path with a state pool runs forward only, got reverse=True")
    if arguments["context_axis"] is not None:
        raise InvalidArgumentError(
            f"reverse: context parallelism carries states forward along T, got reverse=True with "
            f"context_axis={arguments['context_axis']!r}"
        )
    order = reversed_tokens(arguments["q"].shape[1], arguments["cu_seqlens"])
    for name in ("q", "k", "v", "g", "gk"):
        if name in arguments:
            arguments[name] = reverse_time(arguments[name], order)
    o, final_state = dispatch_by_name(op, arguments, **how)
    return reverse_time(o, order), final_state


def fused_recurrent_simple_gla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array | None = None,
    g_gamma: jax.Array | None = None,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: jax.Array | None = None,
    *,
    context_axis: str | None = None,
    transpose_state_layout: bool | None = None,
    ssm_state_indices: jax.Array | None = None,
    num_accepted_tokens: jax.Array | None = None,
    inplace_final_state: bool = True,
    cu_seqlens_cpu=None,
) -> tuple[jax.Array, jax.Array | None]:
    """Simple gated linear attention by the token-by-token recurrence (the decode path).

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V].
      g: [B, T, H] per-step log decays, or None; g_gamma: [H] per-head log decay, or None.
      scale, initial_state, output_final_state, state_v_first, cu_seqlens: as `chunk_simple_gla`.
      reverse: run every sequence from its last token to its first (the state after the first
        token is the final state).
      transpose_state_layout: FLA's deprecated name of `state_v_first`.
      ssm_state_indices: the serving decode path (vLLM): `initial_state` is a pool [P, H, K, V] of
        states and this int32 [N] (a slot per sequence) or [N, S] (a slot per token, speculative
        decoding) says which slots each sequence reads and writes (`gla_core.state_args`; negative
        = padding). Runs `decode` (Pallas TPU) or `decode_xla`.
      num_accepted_tokens: int32 [N] with 2-D indices: sequence n starts from slot
        `ssm_state_indices[n, num_accepted_tokens[n] - 1]`.
      inplace_final_state: with a pool, return the updated pool as the final state (True; donate
        the pool to update it without a copy), or the state after every token [B, T, H, K, V] (False).
      cu_seqlens_cpu: FLA's host copy of `cu_seqlens` (needed with 1-D indices and packed sequences
        under `jax.jit`: it gives the longest sequence).
      context_axis: the mesh axis T is sharded over, inside `jax.shard_map` (context parallelism, see
        `gla_core.context_parallel`); None: this device holds whole sequences.

    Returns:
      `(o, final_state)`: o [B, T, H, V] in v's dtype; final_state [N, H, K, V] float32 or None —
      with a pool, the updated pool (or the per-token states).

    Example (one decode step of 4 sequences whose states live in a pool of 16 slots):
      >>> q = k = v = jnp.ones((4, 1, 2, 64)); pool = jnp.zeros((16, 2, 64, 64))
      >>> o, pool = fused_recurrent_simple_gla(q, k, v, g_gamma=jnp.full((2,), -0.1), initial_state=pool,
      ...                                      ssm_state_indices=jnp.array([3, 0, 7, 9], jnp.int32))
      >>> o.shape, pool.shape
      ((4, 1, 2, 64), (16, 2, 64, 64))
    """
    arguments = dict(locals())
    for name in ("reverse", "transpose_state_layout"):
        del arguments[name]
    return _recurrent("simple_gla", arguments, reverse, transpose_state_layout)


def fused_recurrent_gla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    gk: jax.Array | None = None,
    gv: jax.Array | None = None,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: jax.Array | None = None,
    *,
    context_axis: str | None = None,
    transpose_state_layout: bool | None = None,
    ssm_state_indices: jax.Array | None = None,
    num_accepted_tokens: jax.Array | None = None,
    inplace_final_state: bool = True,
    cu_seqlens_cpu=None,
) -> tuple[jax.Array, jax.Array | None]:
    """Gated linear attention with a per-key decay by the token-by-token recurrence (the decode path).

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V].
      gk: [B, T, H, K] per-key log decays, or None for no decay (as in FLA; the call then runs
        op simple_gla without a gate, which is the same recurrence).
      gv: FLA's per-value decay [B, T, H, V]: not supported (must be None).
      scale, initial_state, output_final_state, reverse, state_v_first, cu_seqlens,
      transpose_state_layout, ssm_state_indices, num_accepted_tokens, inplace_final_state,
      cu_seqlens_cpu: as in `fused_recurrent_simple_gla`.
      context_axis: the mesh axis T is sharded over, inside `jax.shard_map` (context parallelism, see
        `gla_core.context_parallel`); None: this device holds whole sequences.

    Returns:
      `(o, final_state)`: o [B, T, H, V] in v's dtype; final_state [N, H, K, V] float32 or None
      (with a pool: the updated pool, or the per-token states).

    Example:
      >>> q = k = v = jnp.ones((1, 16, 2, 32)); gk = jnp.full((1, 16, 2, 32), -0.05)
      >>> o, ht = fused_recurrent_gla(q, k, v, gk=gk, output_final_state=True)
      >>> o.shape, ht.shape
      ((1, 16, 2, 32), (1, 2, 32, 32))
    """
    if gv is not None:
        raise InvalidArgumentError(
            f"gv: FLA's per-value decay is not supported by gla (gk is the per-key decay), got {describe(gv)}"
        )
    arguments = dict(locals())
    for name in ("gv", "reverse", "transpose_state_layout"):
        del arguments[name]
    if gk is None:  # no decay: the simple_gla recurrence without a gate
        del arguments["gk"]
        return _recurrent("simple_gla", arguments, reverse, transpose_state_layout)
    return _recurrent("gla", arguments, reverse, transpose_state_layout)


def parallel_simple_gla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array | None = None,
    scale: float | None = None,
    output_attentions: bool = False,
    cu_seqlens: jax.Array | None = None,
    cu_seqlens_cpu=None,
) -> tuple[jax.Array, jax.Array | None]:
    """Simple gated linear attention in FLA's parallel form, optionally with its attention matrix.

    o_i = sum_{j <= i} A[i, j] v_j with A[i, j] = scale · q_i·k_j · exp(g_{j+1} + ... + g_i): the
    same function as `chunk_simple_gla` without a state (which computes `o`, on the chunked family).

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V].
      g: [B, T, H] per-step log decays, or None.
      scale: default K ** -0.5.
      output_attentions: also return the attention matrix A [B, H, T, T] (q's dtype), for analysis
        (T x T memory); not with `cu_seqlens` (as in FLA).
      cu_seqlens: [N+1] int32 packed boundaries (B == 1), or None.
      cu_seqlens_cpu: FLA's host copy of `cu_seqlens`, checked against it.

    Returns:
      `(o [B, T, H, V] in v's dtype, A [B, H, T, T] or None)`.

    Example:
      >>> q = k = v = jnp.ones((1, 32, 2, 16)); g = jnp.full((1, 32, 2), -0.1)
      >>> o, attn = parallel_simple_gla(q, k, v, g, output_attentions=True)
      >>> o.shape, attn.shape
      ((1, 32, 2, 16), (1, 2, 32, 32))
    """
    if not isinstance(output_attentions, bool):
        raise InvalidArgumentError(f"output_attentions: expected a bool, got {output_attentions!r}")
    if output_attentions and cu_seqlens is not None:
        raise InvalidArgumentError(
            "output_attentions: the attention matrix of packed sequences is not supported (as in FLA), "
            "got output_attentions=True with cu_seqlens"
        )
    arguments = dict(q=q, k=k, v=v, g=g, scale=scale, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    o, _ = dispatch_by_name("simple_gla", arguments, among=CHUNK_FAMILY)
    if not output_attentions:
        return o, None
    return o, attention_matrix(q, k, g, q.shape[-1] ** -0.5 if scale is None else scale)
