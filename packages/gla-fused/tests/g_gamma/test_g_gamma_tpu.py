"""`fused_g_gamma` at production shapes for TPU: `jax.export` lowering and libtpu compile-only
compiles (v5e, v6e).

Shape: B=2, T=4096, H=16, K=V=128 bf16, g_gamma float32 [H], with h0 and the final state.
The training step is `grad(sum(o * do) + sum(final_state))` over q, k, v, g_gamma and h0,
and also returns o: exactly one forward and one backward kernel. Compile tests cover chunk
sizes 16, 64 (the default) and 128, print each kernel's scoped VMEM and the step's temp
memory (`pytest -s`) and check the VMEM fits the chip's default scoped VMEM limit.
Under `jax.vmap` the kernels fold the mapped axis into B (still one kernel per direction);
a mapped g_gamma runs them in a loop over the mapped elements.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import gla_core
from gla_core.kit import DEFAULT_SCOPED_VMEM_BYTES, compile_for_tpu, export_for_tpu

BATCH, SEQ_LEN, HEADS, DIM = 2, 4096, 16, 128
# Mosaic's default scoped VMEM limit per kernel (without --xla_tpu_scoped_vmem_limit_kib).
KERNELS = ["fused_g_gamma_fwd", "fused_g_gamma_bwd"]


def _structs():
    """(q, k, v, g_gamma, initial_state, do) at the production shape."""
    bf16 = jnp.bfloat16
    qkv = jax.ShapeDtypeStruct((BATCH, SEQ_LEN, HEADS, DIM), bf16)
    return [
        qkv,
        qkv,
        qkv,
        jax.ShapeDtypeStruct((HEADS,), jnp.float32),
        jax.ShapeDtypeStruct((BATCH, HEADS, DIM, DIM), jnp.float32),
        qkv,
    ]


def forward(q, k, v, g_gamma, initial_state, chunk_size=64):
    return gla_core.dispatch(
        "simple_gla",
        q,
        k,
        v,
        g_gamma=g_gamma,
        initial_state=initial_state,
        output_final_state=True,
        chunk_size=chunk_size,
        impl="fused_g_gamma",
    )


def train(q, k, v, g_gamma, initial_state, do, chunk_size=64):
    def loss(*differentiable):
        o, final_state = forward(*differentiable, chunk_size=chunk_size)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(final_state), o

    grads, o = jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, g_gamma, initial_state)
    return o, grads


def _mosaic_calls(exported) -> int:
    return exported.mlir_module().count("tpu_custom_call")


@pytest.mark.lowering
def test_fused_g_gamma_exports_one_kernel_per_direction():
    structs = _structs()
    assert _mosaic_calls(export_for_tpu(forward, *structs[:5])) == 1
    assert _mosaic_calls(export_for_tpu(train, *structs)) == 2


VMAP_SIZE = 2


@pytest.mark.lowering
@pytest.mark.parametrize("g_gamma_mapped", [False, True], ids=["shared g_gamma", "mapped g_gamma"])
def test_fused_g_gamma_vmap_exports_for_tpu(g_gamma_mapped):
    in_axes = (0, 0, 0, 0 if g_gamma_mapped else None, 0, 0)
    structs = [
        s if axis is None else jax.ShapeDtypeStruct((VMAP_SIZE, *s.shape), s.dtype)
        for s, axis in zip(_structs(), in_axes, strict=True)
    ]
    assert _mosaic_calls(export_for_tpu(jax.vmap(train, in_axes=in_axes), *structs)) == 2


@pytest.mark.tpu_compile
@pytest.mark.parametrize("chip", sorted(DEFAULT_SCOPED_VMEM_BYTES))
@pytest.mark.parametrize("chunk_size", [16, 64, 128])
def test_fused_g_gamma_compiles_for_tpu(chunk_size, chip):
    step = functools.partial(train, chunk_size=chunk_size)
    report = compile_for_tpu(step, _structs(), chip=chip)
    print(f"\nfused_g_gamma training step, chunk {chunk_size}, {report.summary()}, temp bytes {report.temp_bytes}")
    assert sorted(kernel.name for kernel in report.kernels) == sorted(KERNELS)
    for kernel in report.kernels:
        assert 0 < kernel.scoped_vmem_bytes <= DEFAULT_SCOPED_VMEM_BYTES[chip], kernel
