"""FLA-named entry points of gla-kda: `chunk_kda`, `fused_recurrent_kda`, `fused_kda_gate`.

Each takes FLA's arguments with FLA's names, order and defaults (gla's extras, e.g. `chunk_size`,
`interpret`, and FLA's `**kwargs` entries A_log/dt_bias of `chunk_kda`, come after them,
keyword-only) and validates through `gla_core.dispatch` with a fixed implementation family, so the
arguments, errors and gradients are those of the op `kda` / `kda_gate`.
"""

from __future__ import annotations

import gla_core
from gla_core.errors import InvalidArgumentError, describe
from gla_core.kit import DEFAULT_CHUNK_SIZE, decode, dispatch_by_name, state_v_first_of

CHUNK_FAMILY = ("chunk", "xla")  # chunk_kda: the Pallas chunk pipeline when it accepts, else the XLA one
DECODE_FAMILY = decode.registration.FAMILY  # fused_recurrent_kda with a state pool: ("decode", "decode_xla")


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    safe_gate=False,
    lower_bound=None,
    disable_recompute=False,
    return_intermediate_states=False,
    state_v_first=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    cp_context=None,
    *,
    context_axis: str | None = None,
    A_log=None,
    dt_bias=None,
    chunk_size=DEFAULT_CHUNK_SIZE,
    transpose_state_layout=None,
    interpret=None,
):
    """Kimi Delta Attention, chunked (training path).

    Per step and value head: `S <- diag(exp(g_t)) S`, then
    `S <- S + beta_t k_t (v_t - S^T k_t)^T`, and `o_t = scale * S^T q_t`.

    Runs implementation "chunk" (Pallas TPU pipeline) when it accepts the call — on a TPU
    backend, or anywhere in TPU interpret mode (`interpret=True`, `GLA_INTERPRET=1`,
    `gla_core.use(interpret=True)`) — and the chunked XLA implementation "xla" otherwise
    (CPU/GPU default, and the calls "chunk" declines: `return_intermediate_states`). Both compute
    the same function with a backward.

    Args:
      q: [B, T, H, K] queries.
      k: [B, T, H, K] keys.
      v: [B, T, HV, V] values; HV a multiple of H (value head j reads q/k head j // (HV // H)).
      g: [B, T, HV, K] per-key log decay (<= 0), or the raw gate input when `use_gate_in_kernel`.
      beta: [B, T, HV] write strength in (0, 1), or logits when `use_beta_sigmoid_in_kernel`.
      scale: query scale, default K ** -0.5.
      initial_state: [N, HV, K, V] state before the first step (N = B, or the number of
        sequences with `cu_seqlens`); zeros when None. [N, HV, V, K] with `state_v_first`.
      output_final_state: also return the state after the last step of every sequence.
      use_qk_l2norm_in_kernel: L2-normalize q and k over K (x / sqrt(sum x^2 + 1e-6)).
      use_gate_in_kernel: compute the log decay from g: `-exp(A_log) * softplus(g + dt_bias)`, or
        `lower_bound * sigmoid(exp(A_log) * (g + dt_bias))` when `lower_bound` is given
        (`lower_bound * sigmoid(g + dt_bias)` when A_log is None).
      use_beta_sigmoid_in_kernel: apply a sigmoid to beta.
      allow_neg_eigval: with `use_beta_sigmoid_in_kernel`, beta = 2 * sigmoid(beta), in (0, 2)
        (the transition I - beta k k^T may have negative eigenvalues).
      safe_gate: FLA's kernel choice for gates bounded below by `lower_bound` (with
        `use_gate_in_kernel`, lower_bound must be in [-5, 0)); the same function here.
      lower_bound: negative float. With `use_gate_in_kernel`, the gate's lower bound (above); without,
        the stated bound of the given g (FLA's safe-gate calls; g is used as given).
      disable_recompute: keep the intermediates for the backward instead of recomputing them
        (memory for speed; the Pallas pipeline keeps the per-chunk states its forward writes).
      return_intermediate_states: also return the state entering every chunk, h [B, NT, HV, K, V]
        in q's dtype (NT = ceil(T / chunk_size); packed: B = 1 and the chunks of every sequence in
        order, which needs host boundaries: `cu_seqlens_cpu` or a concrete `cu_seqlens`).
      state_v_first: every state is [.., V, K] instead of [.., K, V] (FLA's V-first layout).
      cu_seqlens: [N+1] int32 boundaries of packed sequences (B == 1); may be traced under jit.
      cu_seqlens_cpu: FLA's host copy of `cu_seqlens`, checked against it.
      cp_context: FLA's torch context-parallel object: must be None (gla's context parallelism runs
        inside `jax.shard_map`, DESIGN.md section 8).
      A_log: [HV] or FLA's [1, 1, HV, 1] (with `use_gate_in_kernel`; None with a lower_bound).
      dt_bias: [HV * K] optional (with `use_gate_in_kernel`).
      chunk_size: 16, 32, 64 or 128.
      transpose_state_layout: FLA's deprecated name of `state_v_first`.
      interpret: run Pallas kernels in TPU interpret mode (default: the global setting).
      context_axis: the mesh axis T is sharded over, inside `jax.shard_map` (context parallelism, see
        `gla_core.context_parallel`); None: this device holds whole sequences.

    Returns:
      (o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32 or None), and h as a third
      result with `return_intermediate_states`.

    Example:
      >>> q = k = jnp.ones((1, 128, 2, 64)); v = jnp.ones((1, 128, 4, 64))
      >>> g = -0.1 * jnp.ones((1, 128, 4, 64)); beta = 0.5 * jnp.ones((1, 128, 4))
      >>> o, ht = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True)
      >>> o.shape, ht.shape
      ((1, 128, 4, 64), (1, 4, 64, 64))
    """
    _no_context_parallel(cp_context)
    arguments = dict(locals(), state_v_first=state_v_first_of(state_v_first, transpose_state_layout))
    for name in ("cp_context", "transpose_state_layout"):
        del arguments[name]
    return dispatch_by_name("kda", arguments, among=CHUNK_FAMILY)


def fused_recurrent_kda(
    q,
    k,
    v,
    g,
    beta,
    A_log=None,
    dt_bias=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    lower_bound=None,
    state_v_first=False,
    cu_seqlens=None,
    *,
    context_axis: str | None = None,
    transpose_state_layout=None,
    ssm_state_indices=None,
    num_accepted_tokens=None,
    inplace_final_state=True,
    cu_seqlens_cpu=None,
    chunk_size=DEFAULT_CHUNK_SIZE,
    interpret=None,
):
    """Kimi Delta Attention, step by step (decode path).

    Same arguments, semantics and results as `chunk_kda` (without its chunk-only flags): the
    `recurrent` implementation, a `lax.scan` over time, cheapest for short T such as one-token
    decoding with a carried state. With `ssm_state_indices` it is the serving decode path (vLLM's
    use): `initial_state` is a pool [P, HV, K, V] of states, and the Pallas kernel `decode` (or
    `decode_xla` where it declines) reads and writes the slots of every sequence.

    Args:
      q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_*,
      allow_neg_eigval, lower_bound, state_v_first, cu_seqlens, transpose_state_layout: as `chunk_kda`.
      ssm_state_indices: int32 [N] (a slot per sequence: read, then written with the state after its
        last token) or [N, S] (a slot per token, speculative decoding: the state after token t goes to
        slot [n, t]); negative = padding (nothing read or written). `gla_core.state_args` has the rules.
      num_accepted_tokens: int32 [N] with 2-D indices: sequence n starts from slot
        `ssm_state_indices[n, num_accepted_tokens[n] - 1]`.
      inplace_final_state: with a pool, return the updated pool (True; donate the pool buffer to
        update it in place) or the state after every token [B, T, HV, K, V] (False).
      cu_seqlens_cpu: FLA's host copy of `cu_seqlens` (with 1-D indices and packed sequences under
        `jax.jit` it gives the longest sequence).
      chunk_size: steps per checkpointed segment of the recurrence's backward.
      interpret: run Pallas kernels in TPU interpret mode (default: the global setting).
      context_axis: the mesh axis T is sharded over, inside `jax.shard_map` (context parallelism, see
        `gla_core.context_parallel`); None: this device holds whole sequences.

    Returns:
      (o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32 or None — with a pool, the
      updated pool, or the per-token states).

    Example:
      >>> # one decoding step for 8 sequences whose states live in a pool of 64 slots
      >>> o, pool = fused_recurrent_kda(q_t, k_t, v_t, g_t, beta_t, initial_state=pool, ssm_state_indices=slots)
      >>> # q_t, k_t [8, 1, H, K]; v_t [8, 1, HV, V]; g_t [8, 1, HV, K]; beta_t [8, 1, HV]; pool [64, HV, K, V]
    """
    arguments = dict(locals(), state_v_first=state_v_first_of(state_v_first, transpose_state_layout))
    del arguments["transpose_state_layout"]
    how = {"impl": "recurrent"} if ssm_state_indices is None else {"among": DECODE_FAMILY}
    return dispatch_by_name("kda", arguments, **how)


def _no_context_parallel(cp_context) -> None:
    if cp_context is not None:
        raise InvalidArgumentError(
            f"cp_context: FLA's torch context-parallel object has no JAX counterpart; expected None, got "
            f"{describe(cp_context)} (gla's context parallelism runs inside jax.shard_map, DESIGN.md section 8)"
        )


def fused_kda_gate(g, A_log=None, dt_bias=None, lower_bound=None, output_dtype=None):
    """The KDA log decay computed from a raw gate input (op kda_gate, implementation "xla").

    `-exp(A_log) * softplus(g + dt_bias)`, or `lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`
    when `lower_bound` is given (`lower_bound * sigmoid(g + dt_bias)` when A_log is None, as FLA's).
    Differentiable in g, A_log and dt_bias.

    Args:
      g: [B, T, HV, K] raw gate input.
      A_log: [HV] (or FLA's [1, 1, HV, 1]) log decay rate per value head; None needs a lower_bound.
      dt_bias: [HV * K] optional bias.
      lower_bound: optional negative float.
      output_dtype: dtype of the result (default: float32, as FLA's `torch.float32`; float64 for
        float64 g).

    Returns:
      [B, T, HV, K] log decay (<= 0) in `output_dtype`.

    Example:
      >>> gate = fused_kda_gate(g, A_log, dt_bias)   # g [1, 128, 4, 64], A_log [4], dt_bias [256]
      >>> o, _ = chunk_kda(q, k, v, gate, beta)
    """
    return gla_core.dispatch(
        "kda_gate", g, impl="xla", A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, output_dtype=output_dtype
    )
