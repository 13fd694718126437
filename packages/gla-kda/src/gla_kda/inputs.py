"""What every kda implementation does to its inputs before the delta-rule recurrence.

`prepare_inputs` applies the in-kernel options in the packed `[B, T, ...]` layout (before any
chunk padding, so padded slots stay exactly zero):

  q, k   -> float32, L2-normalized over K when `use_qk_l2norm_in_kernel`; q multiplied by
            `scale` (the only place the scale is applied)
  g      -> the log decay: `kda_gate(g, A_log, dt_bias, lower_bound)` when `use_gate_in_kernel`,
            raised to `log_decay_floor` (`floor_log_decay`)
  beta   -> `sigmoid(beta)` when `use_beta_sigmoid_in_kernel` (`2 sigmoid(beta)` with `allow_neg_eigval`)
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

# exp(floor) rounds to 0 in the dtype (it is below half the smallest subnormal: float32
# e^-104 = 6.8e-46 < 7.0e-46, float64 e^-746 = 9.8e-325 < 2.5e-324), and so does the
# exp of any sum with it: raising a stronger decay (down to -inf, a hard reset) to the floor
# changes no decay and no gradient computed in that dtype; both are exactly 0 either way.
_LOG_DECAY_FLOORS = {"float32": -104.0, "float64": -746.0}


def log_decay_floor(dtype) -> float:
    """The most negative log decay the chunked forms compute with, for a compute dtype (float32 or float64)."""
    return _LOG_DECAY_FLOORS[jnp.dtype(dtype).name]


def floor_log_decay(g):
    """Raises the log decays g (any shape, float32 or float64) to `log_decay_floor`; NaN stays NaN.

    Chunked forms combine decays by sums inside a chunk, and matmuls with 0/1 masks: a -inf
    gate (decay exactly 0) would meet a 0 and give NaN, and a huge finite one (-1e30) would wipe
    out the digits of every sum it enters. At the floor both behave as the hard reset they are.
    """
    floor = log_decay_floor(g.dtype)
    return jnp.where(g < floor, jnp.asarray(floor, g.dtype), g)


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


def prepare_inputs(args) -> Prepared:
    """Applies the in-kernel options of a kda call's validated arguments record (see the module
    docstring); shapes as in `Prepared`."""
    dtype = compute_dtype(args.q.dtype)
    q = args.q.astype(dtype)
    k = args.k.astype(dtype)
    if args.use_qk_l2norm_in_kernel:
        q = l2norm(q)
        k = l2norm(k)
    q = q * args.scale
    g = args.g
    if args.use_gate_in_kernel:
        g = kda_gate(g, args.A_log, args.dt_bias, args.lower_bound, output_dtype=dtype)
    g = floor_log_decay(g.astype(dtype))
    beta = beta_of(args, dtype)
    return Prepared(q=q, k=k, v=args.v.astype(dtype), g=g, beta=beta)


def beta_of(args, dtype):
    """The delta-rule strength beta [B, T, HV] of a kda arguments record in `dtype`: `sigmoid(beta)` with
    `use_beta_sigmoid_in_kernel`, `2 * sigmoid(beta)` (in (0, 2), FLA's negative eigenvalues) when
    `allow_neg_eigval` too, else beta as given."""
    beta = args.beta.astype(dtype)
    if args.use_beta_sigmoid_in_kernel:
        beta = jax.nn.sigmoid(beta)
        if getattr(args, "allow_neg_eigval", False):
            beta = 2.0 * beta
    return beta


def expand_value_heads(x, num_value_heads: int):
    """[B, T, H, K] -> [B, T, HV, K], head h repeated for value heads h*m .. h*m+m-1 (m = HV // H)."""
    num_heads = x.shape[2]
    if num_heads == num_value_heads:
        return x
    return jnp.repeat(x, num_value_heads // num_heads, axis=2)
