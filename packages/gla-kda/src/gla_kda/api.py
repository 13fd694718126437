"""FLA-named entry points of gla-kda: `chunk_kda`, `fused_recurrent_kda`, `fused_kda_gate`.

Each validates through `gla_core.dispatch` with a fixed implementation family, so the
arguments, errors and gradients are those of the op `kda` / `kda_gate`.
"""

from __future__ import annotations

import gla_core
from gla_core.kit import dispatch_by_name

CHUNK_FAMILY = ("chunk", "xla")  # chunk_kda: the Pallas chunk pipeline when it accepts, else the XLA one


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
    cu_seqlens=None,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    use_beta_sigmoid_in_kernel=False,
    chunk_size=64,
    interpret=None,
):
    """Kimi Delta Attention, chunked (training path).

    Per step and value head: `S <- diag(exp(g_t)) S`, then
    `S <- S + beta_t k_t (v_t - S^T k_t)^T`, and `o_t = scale * S^T q_t`.

    Runs implementation "chunk" (Pallas TPU pipeline) when it accepts the call — on a TPU
    backend, or anywhere in TPU interpret mode (`interpret=True`, `GLA_INTERPRET=1`,
    `gla_core.use(interpret=True)`) — and the chunked XLA implementation "xla" otherwise
    (CPU/GPU default). Both compute the same function with a `custom_vjp` backward.

    Args:
      q: [B, T, H, K] queries.
      k: [B, T, H, K] keys.
      v: [B, T, HV, V] values; HV a multiple of H (value head j reads q/k head j // (HV // H)).
      g: [B, T, HV, K] per-key log decay (<= 0), or the raw gate input when `use_gate_in_kernel`.
      beta: [B, T, HV] write strength in (0, 1), or logits when `use_beta_sigmoid_in_kernel`.
      scale: query scale, default K ** -0.5.
      initial_state: [N, HV, K, V] state before the first step (N = B, or the number of
        sequences with `cu_seqlens`); zeros when None.
      output_final_state: also return the state after the last step of every sequence.
      use_qk_l2norm_in_kernel: L2-normalize q and k over K (x / sqrt(sum x^2 + 1e-6)).
      use_gate_in_kernel: compute the log decay from g: `-exp(A_log) * softplus(g + dt_bias)`, or
        `lower_bound * sigmoid(exp(A_log) * (g + dt_bias))` when `lower_bound` is given.
      cu_seqlens: [N+1] int32 boundaries of packed sequences (B == 1); may be traced under jit.
      A_log: [HV] (with `use_gate_in_kernel`).
      dt_bias: [HV * K] optional (with `use_gate_in_kernel`).
      lower_bound: optional negative float (with `use_gate_in_kernel`).
      use_beta_sigmoid_in_kernel: apply a sigmoid to beta.
      chunk_size: 16, 32, 64 or 128.
      interpret: run Pallas kernels in TPU interpret mode (default: the global setting).

    Returns:
      (o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32 or None).

    Example:
      >>> q = k = jnp.ones((1, 128, 2, 64)); v = jnp.ones((1, 128, 4, 64))
      >>> g = -0.1 * jnp.ones((1, 128, 4, 64)); beta = 0.5 * jnp.ones((1, 128, 4))
      >>> o, ht = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True)
      >>> o.shape, ht.shape
      ((1, 128, 4, 64), (1, 4, 64, 64))
    """
    return dispatch_by_name("kda", locals(), among=CHUNK_FAMILY)


def fused_recurrent_kda(
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
    cu_seqlens=None,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    use_beta_sigmoid_in_kernel=False,
):
    """Kimi Delta Attention, step by step (decode path): implementation "recurrent".

    Same arguments, semantics and results as `chunk_kda` (without `chunk_size`): a `lax.scan`
    over time, cheapest for short T such as one-token decoding with a carried state.

    Returns:
      (o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32 or None).

    Example:
      >>> # one decoding step for 8 sequences, carrying the state
      >>> o, state = fused_recurrent_kda(q_t, k_t, v_t, g_t, beta_t, initial_state=state, output_final_state=True)
      >>> # q_t, k_t [8, 1, H, K]; v_t [8, 1, HV, V]; g_t [8, 1, HV, K]; beta_t [8, 1, HV]; state [8, HV, K, V]
    """
    return dispatch_by_name("kda", locals(), impl="recurrent")


def fused_kda_gate(g, A_log, dt_bias=None, lower_bound=None, output_dtype=None):
    """The KDA log decay computed from a raw gate input (op kda_gate, implementation "xla").

    `-exp(A_log) * softplus(g + dt_bias)`, or `lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`
    when `lower_bound` is given. Differentiable in g, A_log and dt_bias.

    Args:
      g: [B, T, HV, K] raw gate input.
      A_log: [HV] log decay rate per value head.
      dt_bias: [HV * K] optional bias.
      lower_bound: optional negative float.
      output_dtype: dtype of the result (default: float32, or float64 for float64 g).

    Returns:
      [B, T, HV, K] log decay (<= 0) in `output_dtype`.

    Example:
      >>> gate = fused_kda_gate(g, A_log, dt_bias)   # g [1, 128, 4, 64], A_log [4], dt_bias [256]
      >>> o, _ = chunk_kda(q, k, v, gate, beta)
    """
    return gla_core.dispatch(
        "kda_gate", g, impl="xla", A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, output_dtype=output_dtype
    )
