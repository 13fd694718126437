"""The dq/dk/gate kernel multiplies in float32 for bfloat16 inputs exactly when d g_gamma is asked
for (its sum over the batch cancels, see `gla_core.chunk.pipeline.define_chunk_vjp`); the
accuracy this buys is checked against the oracle by the fuzzer's regression cases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from gla_core.kit import chunk_gated_attention

B, T, H, K, V = 1, 64, 2, 32, 32


def _kernel_dot_dtypes(jaxpr, kernel_name: str) -> set[str]:
    """dtypes of the operands of every dot inside the Pallas kernel `kernel_name` of `jaxpr`."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call" and kernel_name in str(eqn.params.get("name")):
            kernel = eqn.params["jaxpr"]
            found |= {str(v.aval.dtype) for e in kernel.eqns if e.primitive.name == "dot_general" for v in e.invars}
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                found |= _kernel_dot_dtypes(inner, kernel_name)
    return found


def _gradient_jaxpr(dtype, argnums):
    q = jnp.ones((B, T, H, K), dtype)
    v = jnp.ones((B, T, H, V), dtype)
    g = jnp.full((B, T, H), -0.1, jnp.float32)
    g_gamma = jnp.full((H,), -0.01, jnp.float32)

    def loss(q, g, g_gamma):
        o, _ = chunk_gated_attention(q, q, v, g=g, g_gamma=g_gamma, chunk_size=16, interpret=True)
        return jnp.sum(o.astype(jnp.float32))

    return jax.make_jaxpr(jax.grad(loss, argnums=argnums))(q, g, g_gamma).jaxpr


@pytest.mark.parametrize(
    ("dtype", "argnums", "bfloat16_products"),
    [
        (jnp.bfloat16, (0, 1, 2), False),  # d g_gamma asked for: float32 products only
        (jnp.bfloat16, (2,), False),
        (jnp.bfloat16, (0, 1), True),  # g_gamma constant: the MXU's bfloat16 where it is exact enough
        (jnp.float32, (0, 1, 2), False),
    ],
)
def test_gate_kernel_multiplies_in_float32_only_for_d_g_gamma(dtype, argnums, bfloat16_products):
    dtypes = _kernel_dot_dtypes(_gradient_jaxpr(dtype, argnums), "chunk_bwd_dqkg")
    assert dtypes and ("bfloat16" in dtypes) == bfloat16_products, dtypes
