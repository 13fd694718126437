"""What every kda implementation does to its inputs before the delta-rule recurrence.

`prepare_inputs` applies the in-kernel options in the packed `[B, T, ...]` layout (before any
chunk padding, so padded slots stay exactly zero):

  q, k   -> float32, L2-normalized over K when `use_qk_l2norm_in_kernel`; q multiplied by
            `scale` (the only place the scale is applied)
  g      -> the log decay: `kda_gate(g, A_log, dt_bias, lower_bound)` when `use_gate_in_kernel`
  beta   -> `sigmoid(beta)` when `use_beta_sigmoid_in_kernel`
  v      -> float32

Each step is differentiable (l2norm and the gate carry their own `custom_vjp`), so an
implementation that differentiates its core in these prepared tensors gets the gradients of
the raw inputs by the chain rule. `expand_value_heads` repeats q/k heads for grouped value
heads (HV = m * H; value head j reads q/k head j // m); its transpose sums over each group.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gla_kda.gate import compute_dtype, kda_gate
from gla_kda.l2norm import l2norm


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Inputs of the plain delta-rule recurrence, float32 (float64 for float64 inputs).

    q, k: [B, T, H, K] (q already scaled); v: [B, T, HV, V]; g: [B, T, HV, K] log decay;
    beta: [B, T, HV].
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array


def prepare_inputs(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale: float,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log=None,
    dt_bias=None,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
) -> Prepared:
    """Applies the in-kernel options of kda (see the module docstring); shapes as in `Prepared`."""
    dtype = compute_dtype(q.dtype)
    q = q.astype(dtype)
    k = k.astype(dtype)
    if use_qk_l2norm_in_kernel:
        q = l2norm(q)
        k = l2norm(k)
    q = q * scale
    g = kda_gate(g, A_log, dt_bias, lower_bound, output_dtype=dtype) if use_gate_in_kernel else g.astype(dtype)
    beta = beta.astype(dtype)
    if use_beta_sigmoid_in_kernel:
        beta = jax.nn.sigmoid(beta)
    return Prepared(q=q, k=k, v=v.astype(dtype), g=g, beta=beta)


def expand_value_heads(x, num_value_heads: int):
    """[B, T, H, K] -> [B, T, HV, K], head h repeated for value heads h*m .. h*m+m-1 (m = HV // H)."""
    num_heads = x.shape[2]
    if num_heads == num_value_heads:
        return x
    return jnp.repeat(x, num_value_heads // num_heads, axis=2)
