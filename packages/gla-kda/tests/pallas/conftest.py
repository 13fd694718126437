"""Shared helpers of the kda `chunk` tests: the jitted interpret-mode runner and production shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import gla_core
from gla_ref.testing import Case

# Production shapes of the lowering and compile layers: (B, T, H, HV, K, V), bf16.
PRODUCTION_SHAPES = {
    "B1_T8192_H32": (1, 8192, 32, 32, 128, 128),
    "B2_T4096_H16": (2, 4096, 16, 16, 128, 128),
}
PRODUCTION_NUM_SEQUENCES = 4


def make_chunk_runner(case: Case, interpret: bool = True, options: dict | None = None):
    """`fn(**case.kwargs())` running `dispatch("kda", impl="chunk")` under one `jax.jit`, with the
    implementation's per-call `options` (`impl_options={"chunk": options}`) when given.

    Non-array options are static; arrays, `cu_seqlens` included, are traced (as in training),
    so new boundaries with the same N and T reuse the compiled program. `fn.compiled_count()`
    tells how many programs the runner compiled.
    """
    static = {name: value for name, value in case.options.items() if not isinstance(value, jax.Array)}
    if options is not None:
        static["impl_options"] = {"chunk": options}

    @jax.jit
    def run(arrays):
        return gla_core.dispatch("kda", impl="chunk", interpret=interpret, **arrays, **static)

    def fn(**kwargs):
        return run({name: value for name, value in kwargs.items() if name not in static})

    fn.compiled_count = run._cache_size
    return fn


def production_structs(shape_name: str, varlen: bool, with_cotangent: bool = False):
    """ShapeDtypeStructs (q, k, v, g, beta[, do][, cu_seqlens]) of a production shape, bf16 (g float32).

    Varlen packs the B rows into one row of N = 4 sequences.
    """
    batch, seq_len, heads, value_heads, key_dim, value_dim = PRODUCTION_SHAPES[shape_name]
    if varlen:
        batch, seq_len = 1, batch * seq_len
    struct = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    structs = [
        struct((batch, seq_len, heads, key_dim), bf16),
        struct((batch, seq_len, heads, key_dim), bf16),
        struct((batch, seq_len, value_heads, value_dim), bf16),
        struct((batch, seq_len, value_heads, key_dim), jnp.float32),
        struct((batch, seq_len, value_heads), bf16),
    ]
    if with_cotangent:
        structs.append(struct((batch, seq_len, value_heads, value_dim), bf16))
    if varlen:
        structs.append(struct((PRODUCTION_NUM_SEQUENCES + 1,), jnp.int32))
    return structs


def production_forward(q, k, v, g, beta, cu_seqlens=None):
    """The forward through dispatch to `chunk`, with the final states."""
    return gla_core.dispatch(
        "kda", q, k, v, g=g, beta=beta, impl="chunk", cu_seqlens=cu_seqlens, output_final_state=True
    )


def production_backward(q, k, v, g, beta, do, cu_seqlens=None):
    """Gradients of sum(o * do) with respect to q, k, v, g and beta (a training step's backward)."""

    def loss(q, k, v, g, beta):
        o, _ = gla_core.dispatch("kda", q, k, v, g=g, beta=beta, impl="chunk", cu_seqlens=cu_seqlens)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)


@pytest.fixture
def chunk_runner(interpret):
    """`chunk_runner(case, options=None) -> fn` for `gla_ref.testing.check_against_oracle(fn, case)`
    (interpret mode off TPU; `options`: the chunk implementation's per-call options)."""
    return lambda case, options=None: make_chunk_runner(case, interpret, options)


@pytest.fixture
def production():
    """The production shapes and functions of the lowering and compile layers."""
    return dict(
        shapes=PRODUCTION_SHAPES, structs=production_structs, forward=production_forward, backward=production_backward
    )
