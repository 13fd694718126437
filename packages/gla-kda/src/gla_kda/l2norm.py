"""L2 normalization over the last axis, `y = x / sqrt(sum(x**2) + eps)`, with its backward.

Used by kda's `use_qk_l2norm_in_kernel` on q and k ([B, T, H, K], normalized over K).
Math runs in float32 (float64 stays float64); the result has x's dtype.

`l2norm_forward` / `l2norm_backward` are the building blocks; `l2norm` is the
differentiable public function (`jax.custom_vjp`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

DEFAULT_EPS = 1e-6


def l2norm_forward(x, eps: float = DEFAULT_EPS):
    """Returns `(y, rstd)`: y [..., K] normalized (compute dtype) and rstd [..., 1] = 1/sqrt(sum x^2 + eps)."""
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    rstd = jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)
    return x * rstd, rstd


def l2norm_backward(y, rstd, dy):
    """dx [..., K] from the normalized y, its rstd [..., 1] and the cotangent dy: rstd * (dy - y <dy, y>)."""
    dy = dy.astype(y.dtype)
    return rstd * (dy - y * jnp.sum(dy * y, axis=-1, keepdims=True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _l2norm(x, eps):
    return l2norm_forward(x, eps)[0].astype(x.dtype)


def _l2norm_fwd(x, eps):
    y, rstd = l2norm_forward(x, eps)
    return y.astype(x.dtype), (y, rstd)


def _l2norm_bwd(eps, residuals, dy):
    y, rstd = residuals
    # The output has x's dtype, so dy carries the dtype dx must have.
    return (l2norm_backward(y, rstd, dy).astype(dy.dtype),)


_l2norm.defvjp(_l2norm_fwd, _l2norm_bwd)


def l2norm(x, eps: float = DEFAULT_EPS):
    """L2-normalizes x over its last axis with a hand-written backward.

    Args:
      x: [..., K] any float dtype.
      eps: added to the sum of squares under the square root.

    Returns:
      [..., K] `x / sqrt(sum(x**2, -1) + eps)` in x's dtype (computed in float32).

    Example:
      >>> qn = l2norm(q)        # q [B, T, H, K]
    """
    return _l2norm(x, float(eps))
