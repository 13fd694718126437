"""Input transforms shared by the recurrent and chunked forms: one definition each.

- `compute_dtype`: the dtype every form computes in (promoted inputs, at least float32).
- `l2norm`: KDA's in-kernel q/k normalization.
- `kda_gate`: KDA's in-kernel log decay from a raw gate input, `A_log` and `dt_bias`.
- `expand_heads`: q/k heads repeated for grouped value heads.
- `prepare_kda`: q, k, v, decay and beta of a KDA call after every in-kernel transform.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gla_core.errors import InvalidArgumentError, ShapeError

L2NORM_EPS = 1e-6


def compute_dtype(*arrays) -> jnp.dtype:
    """The promoted dtype of the given arrays (None entries skipped), at least float32."""
    dtypes = [x.dtype for x in arrays if x is not None]
    return jnp.dtype(jnp.result_type(jnp.float32, *dtypes))


def l2norm(x: jax.Array) -> jax.Array:
    """`x / sqrt(sum(x**2, -1) + 1e-6)` over the last axis (the key dim)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def kda_gate(
    g: jax.Array, A_log: jax.Array | None = None, dt_bias: jax.Array | None = None, lower_bound: float | None = None
):
    """KDA's in-kernel log decay.

    Args:
      g: raw gate input `[B, T, HV, K]`.
      A_log: `[HV]` (or FLA's `[1, 1, HV, 1]`) log of the per-head decay rate; may be None with a
        `lower_bound` (the rate is then 1).
      dt_bias: optional `[HV * K]` bias, read as `[HV, K]`.
      lower_bound: optional negative float. None gives `-exp(A_log[h]) * softplus(g + dt_bias)`,
        otherwise `lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias))`, a decay in (lower_bound, 0)
        (`lower_bound * sigmoid(g + dt_bias)` without A_log).

    Returns:
      The per-key log decay `[B, T, HV, K]` in the computation dtype (promoted, at least float32).
    """
    if A_log is None and lower_bound is None:
        raise InvalidArgumentError("A_log: required [HV] array for the in-kernel KDA gate without a lower_bound")
    dtype = compute_dtype(g, A_log, dt_bias)
    num_value_heads, key_dim = g.shape[-2], g.shape[-1]
    if A_log is not None and A_log.shape not in ((num_value_heads,), (1, 1, num_value_heads, 1)):
        raise ShapeError(f"A_log: expected shape [HV] = {(num_value_heads,)} or [1, 1, HV, 1], got {A_log.shape}")
    x = g.astype(dtype)
    if dt_bias is not None:
        if dt_bias.shape != (num_value_heads * key_dim,):
            raise ShapeError(f"dt_bias: expected shape [HV * K] = {(num_value_heads * key_dim,)}, got {dt_bias.shape}")
        x = x + dt_bias.astype(dtype).reshape(num_value_heads, key_dim)
    rate = 1.0 if A_log is None else jnp.exp(A_log.astype(dtype)).reshape(num_value_heads, 1)  # [HV, 1]
    if lower_bound is None:
        return -rate * jax.nn.softplus(x)
    return lower_bound * jax.nn.sigmoid(rate * x)


def expand_heads(x: jax.Array, num_value_heads: int) -> jax.Array:
    """Repeats the heads of `x [B, T, H, ...]` so value head j reads head j // (HV // H)."""
    num_heads = x.shape[2]
    if num_value_heads % num_heads:
        raise ShapeError(f"v: value heads HV = {num_value_heads} must be a multiple of H = {num_heads}")
    return jnp.repeat(x, num_value_heads // num_heads, axis=2)


def prepare_kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    safe_gate=False,
    disable_recompute=False,
    initial_state=None,
):
    """Applies KDA's in-kernel transforms.

    `allow_neg_eigval` (with `use_beta_sigmoid_in_kernel`) makes beta `2 * sigmoid(beta)`, in (0, 2).
    `safe_gate` and a `lower_bound` without `use_gate_in_kernel` select kernels in FLA (the given
    g is promised to lie in [lower_bound, 0]), `disable_recompute` trades memory for speed in FLA's
    backward; they do not change the recurrence.

    Returns `(q, k, v, log_decay, beta)` in the computation dtype (promoted over the inputs and
    `initial_state`, at least float32) with q/k expanded to the
    value heads: q/k `[B, T, HV, K]`, v `[B, T, HV, V]`, log_decay `[B, T, HV, K]`, beta `[B, T, HV]`.
    """
    del safe_gate, disable_recompute  # kernel choices in FLA: the same recurrence
    if g is None:
        raise InvalidArgumentError("g: required for kda (per-key log decay, or raw gate input, [B, T, HV, K])")
    if beta is None:
        raise InvalidArgumentError("beta: required for kda (delta-rule write strength [B, T, HV])")
    if not use_gate_in_kernel and (A_log is not None or dt_bias is not None):
        raise InvalidArgumentError("A_log, dt_bias: only used when use_gate_in_kernel=True")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise InvalidArgumentError("allow_neg_eigval: needs use_beta_sigmoid_in_kernel=True (beta = 2 sigmoid(beta))")
    dtype = compute_dtype(q, k, v, g, beta, A_log, dt_bias, initial_state)
    q, k, v, g, beta = (x.astype(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, lower_bound).astype(dtype)
    if use_beta_sigmoid_in_kernel:
        beta = (2.0 if allow_neg_eigval else 1.0) * jax.nn.sigmoid(beta)
    num_value_heads = v.shape[2]
    return expand_heads(q, num_value_heads), expand_heads(k, num_value_heads), v, g, beta
