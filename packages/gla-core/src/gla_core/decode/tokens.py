"""The prepared tokens of a decode call on the token grid, as the decode kernels read them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gla_core.decode.layout import TokenGrid


def expand_heads(x: jax.Array, num_value_heads: int) -> jax.Array:
    """[B, T, H, X] -> [B, T, HV, X], head h repeated for value heads h*m .. h*m+m-1 (m = HV // H)."""
    heads = x.shape[2]
    return x if heads == num_value_heads else jnp.repeat(x, num_value_heads // heads, axis=2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeTokens:
    """Per-token inputs on the grid, float32 (float64 for float64 inputs): `[N, S_pad, HV, X]`.

    q: [.., K] queries, already scaled; k: [.., K] keys; v: [.., V] values;
    g: [.., 1] scalar or [.., K] per-key log decay (0 in empty cells); beta: [.., 1] delta-rule
    strength, or None for plain gated linear attention.
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array | None

    @classmethod
    def build(cls, grid: TokenGrid, q, k, v, g, beta=None) -> DecodeTokens:
        """From the call's layout: q, k [B, T, H, K] (q scaled); v [B, T, HV, V]; g [B, T, HV, 1 or K]
        log decay; beta [B, T, HV] or None. float32 (float64 for float64 inputs)."""
        heads = v.shape[2]
        dtype = jnp.promote_types(q.dtype, jnp.float32)
        to_grid = lambda x: grid.to_grid(x.astype(dtype))
        return cls(
            q=to_grid(expand_heads(q, heads)),
            k=to_grid(expand_heads(k, heads)),
            v=to_grid(v),
            g=to_grid(g),
            beta=None if beta is None else to_grid(beta[..., None]),
        )
