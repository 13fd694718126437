"""The KDA gate: per-key log decay from a raw gate input, forward and backward.

    x    = g + dt_bias[h, k]                       (dt_bias optional)
    gate = -exp(A_log[h]) * softplus(x)            (no lower bound)
    gate = lower_bound * sigmoid(exp(A_log[h]) * x)  (with lower_bound < 0)
    gate = lower_bound * sigmoid(x)                    (with lower_bound and no A_log, as FLA's)

Shapes: g [..., HV, K] (usually [B, T, HV, K]), A_log [HV] or None, dt_bias [HV * K].
Both forms are <= 0 and never exponentiate a large positive number (softplus and sigmoid
are evaluated in their stable forms). Math is done in float32 (float64 stays float64).

`gate_forward` / `gate_backward` are the elementwise building blocks (also used inside the
kda implementations); `kda_gate` is the differentiable public function (`jax.custom_vjp`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def compute_dtype(dtype) -> jnp.dtype:
    """The dtype gate math runs in: float32, or float64 for float64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


def _broadcast_params(A_log, dt_bias, num_value_heads: int, key_dim: int, dtype):
    """A_log [HV] -> [HV, 1] (zeros, a rate of 1, when None) and dt_bias [HV*K] -> [HV, K] (or None), in `dtype`."""
    a_log = jnp.zeros((num_value_heads, 1), dtype) if A_log is None else A_log.astype(dtype).reshape(num_value_heads, 1)
    bias = None if dt_bias is None else dt_bias.astype(dtype).reshape(num_value_heads, key_dim)
    return a_log, bias


def gate_forward(g, A_log, dt_bias=None, lower_bound=None):
    """The gate in float32 (or float64), same shape as `g`.

    Args:
      g: [..., HV, K] raw gate input.
      A_log: [HV] log of the per-head decay rate; None (a rate of 1) only with a lower_bound.
      dt_bias: [HV * K] optional bias added to g.
      lower_bound: None, or a negative float: the gate then lies in (lower_bound, 0).

    Returns:
      [..., HV, K] natural-log per-step decay (<= 0).
    """
    dtype = compute_dtype(g.dtype)
    num_value_heads, key_dim = g.shape[-2:]
    a_log, bias = _broadcast_params(A_log, dt_bias, num_value_heads, key_dim, dtype)
    x = g.astype(dtype) if bias is None else g.astype(dtype) + bias
    rate = jnp.exp(a_log)
    if lower_bound is None:
        return -rate * jax.nn.softplus(x)
    return lower_bound * jax.nn.sigmoid(rate * x)


def _chain(cotangent, partial):
    """cotangent * partial, exactly 0 where the cotangent is 0 even if the partial is infinite.

    A saturated gate (z = +-inf, rate = inf, softplus = inf) has a zero cotangent and an infinite
    partial; their product must contribute nothing, not NaN.
    """
    return jnp.where(cotangent == 0, 0.0, cotangent * partial)


def gate_backward(dgate, g, A_log, dt_bias=None, lower_bound=None):
    """Gradients of `gate_forward` for a cotangent `dgate` [..., HV, K].

    Returns:
      (dg [..., HV, K], dA_log [HV] or None (no A_log), ddt_bias [HV * K] or None), all in the compute
      dtype (float32, or float64 for float64 inputs); dA_log and ddt_bias are summed over the
      leading axes of g.
    """
    dtype = compute_dtype(g.dtype)
    num_value_heads, key_dim = g.shape[-2:]
    a_log, bias = _broadcast_params(A_log, dt_bias, num_value_heads, key_dim, dtype)
    dgate = dgate.astype(dtype)
    x = g.astype(dtype) if bias is None else g.astype(dtype) + bias
    rate = jnp.exp(a_log)
    if lower_bound is None:
        # gate = -rate * softplus(x): d/dx = -rate * sigmoid(x), d/dA_log = gate.
        dx = _chain(-dgate, rate * jax.nn.sigmoid(x))
        da_elem = _chain(-dgate, rate * jax.nn.softplus(x))
    else:
        # gate = lb * s(z), z = rate * x: d/dz = lb * s(z) (1 - s(z)), dz/dx = rate, dz/dA_log = z.
        # s(z) (1 - s(z)) is formed as s(z) s(-z): 1 - s(z) would cancel to 0 (or noise) for z >~ 8.
        z = rate * x
        dz = _chain(dgate, lower_bound * jax.nn.sigmoid(z) * jax.nn.sigmoid(-z))
        dx = _chain(dz, rate)
        da_elem = _chain(dz, z)
    leading = tuple(range(g.ndim - 2))
    dA_log = None if A_log is None else jnp.sum(da_elem, axis=(*leading, g.ndim - 1))
    ddt_bias = None if dt_bias is None else jnp.sum(dx, axis=leading).reshape(-1)
    return dx, dA_log, ddt_bias


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _kda_gate(g, A_log, dt_bias, lower_bound, output_dtype):
    return gate_forward(g, A_log, dt_bias, lower_bound).astype(output_dtype)


def _kda_gate_fwd(g, A_log, dt_bias, lower_bound, output_dtype):
    return _kda_gate(g, A_log, dt_bias, lower_bound, output_dtype), (g, A_log, dt_bias)


def _kda_gate_bwd(lower_bound, output_dtype, residuals, dgate):
    g, A_log, dt_bias = residuals
    dg, dA_log, ddt_bias = gate_backward(dgate, g, A_log, dt_bias, lower_bound)
    return (
        dg.astype(g.dtype),
        None if A_log is None else dA_log.astype(A_log.dtype),
        None if dt_bias is None else ddt_bias.astype(dt_bias.dtype),
    )


_kda_gate.defvjp(_kda_gate_fwd, _kda_gate_bwd)


def kda_gate(g, A_log, dt_bias=None, lower_bound=None, output_dtype=jnp.float32):
    """The KDA gate with a hand-written backward (fused elementwise XLA).

    Args:
      g: [B, T, HV, K] raw gate input (any float dtype).
      A_log: [HV] log decay rate per value head (None with a lower_bound: a rate of 1).
      dt_bias: [HV * K] optional bias added to g before the nonlinearity.
      lower_bound: None for `-exp(A_log) * softplus(g + dt_bias)`, or a negative float for
        `lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`.
      output_dtype: dtype of the result (default float32).

    Returns:
      [B, T, HV, K] log decay in `output_dtype`. Differentiable in g, A_log and dt_bias.

    Example:
      >>> gate = kda_gate(g, A_log, dt_bias)            # g [2, 64, 4, 32], A_log [4], dt_bias [128]
    """
    lb = None if lower_bound is None else float(lower_bound)
    return _kda_gate(g, A_log, dt_bias, lb, jnp.dtype(output_dtype))


def kda_gate_xla(args):
    """The `xla` implementation of op kda_gate, on the call's validated arguments record."""
    return kda_gate(args.g, args.A_log, args.dt_bias, args.lower_bound, args.output_dtype)
