"""The `fused_chunk` implementation at production shapes for TPU: `jax.export` lowering and
libtpu compile-only compiles (v5e, v6e) of the forward and the training step.

Shapes: B=2, T=4096, H=16, K=V=128 bf16 (the per-chip table's kernel chunk and tokens per grid step:
256 and 512 on v6e, borrowed by v5e), and packed varlen B=1, T=8192, 8 sequences (`cu_seqlens`
traced: per-sequence states by DMA); gates g and g_gamma; with h0 and final state. The training step is
`grad(sum(o * do) + sum(final_state))` over q, k, v, the gate and h0, and also returns o:
fused_chunk_fwd (writing the state before every chunk) and fused_chunk_bwd. Compile tests print
each kernel's scoped VMEM (`pytest -s`) and check it fits the VMEM limit the kernel asks for. Under
`jax.vmap` the kernels fold the mapped axis into B: a vmapped training step exports with the same
Mosaic calls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import gla_core
from gla_core.kit import compile_for_tpu, export_for_tpu

BATCH, SEQ_LEN, HEADS, DIM = 2, 4096, 16, 128
# The kernels ask for at least `KERNEL_VMEM_BUDGET_BYTES` of scoped VMEM, more when their blocks and
# [C, C] temporaries need it (`gla_fused.fused_chunk.forward.sequential_in_time_params`): all heads of
# 512 tokens at chunk 256 take up to 59 MiB, above v5e's default scoped limit of 16 MiB and v6e's 32 MiB.
VMEM_BUDGET = 64 * 2**20
# Packed varlen inputs are XLA gathers, not the caller's arrays, and XLA keeps some of them in VMEM
# for the kernel: the reservation it reports for the kernel then grows by ~30 MiB (the same fixed-length
# forward fed by a gather: 25.1 -> 55.9 MiB on v5e; the packed forward with 8 sequences 66.4 MiB).
# Those must still leave room on the chips' 128 MiB of VMEM.
VARLEN_VMEM_BOUND = 96 * 2**20
FORWARD_KERNELS = ("fused_chunk_fwd",)
TRAINING_KERNELS = ("fused_chunk_fwd", "fused_chunk_bwd")
GATES = ("g", "g_gamma")
LAYOUTS = ("fixed", "varlen")
VARLEN_SEQ_LEN, VARLEN_SEQUENCES = 8192, 8


def _problem(gate: str, layout: str = "fixed"):
    """(forward, training step, forward structs, training structs) for one gate kind and layout
    (varlen: cu_seqlens is the last argument)."""
    bf16 = jnp.bfloat16
    batch, seq_len = (BATCH, SEQ_LEN) if layout == "fixed" else (1, VARLEN_SEQ_LEN)
    num_states = batch if layout == "fixed" else VARLEN_SEQUENCES
    gate_struct = {
        "g": jax.ShapeDtypeStruct((batch, seq_len, HEADS), bf16),
        "g_gamma": jax.ShapeDtypeStruct((HEADS,), jnp.float32),
    }[gate]
    qkv = jax.ShapeDtypeStruct((batch, seq_len, HEADS, DIM), bf16)
    state = jax.ShapeDtypeStruct((num_states, HEADS, DIM, DIM), jnp.float32)
    forward_structs = [qkv, qkv, qkv, gate_struct, state]
    boundaries = [jax.ShapeDtypeStruct((VARLEN_SEQUENCES + 1,), jnp.int32)] if layout == "varlen" else []

    def forward(q, k, v, gate_value, initial_state, cu_seqlens=None):
        return gla_core.dispatch(
            "simple_gla",
            q,
            k,
            v,
            **{gate: gate_value},
            initial_state=initial_state,
            output_final_state=True,
            cu_seqlens=cu_seqlens,
            impl="fused_chunk",
        )

    def train(q, k, v, gate_value, initial_state, do, cu_seqlens=None):
        def loss(*differentiable):
            o, final_state = forward(*differentiable, cu_seqlens)
            return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(final_state), o

        grads, o = jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, gate_value, initial_state)
        return o, grads

    return forward, train, [*forward_structs, *boundaries], [*forward_structs, qkv, *boundaries]


def _mosaic_calls(exported) -> int:
    return exported.mlir_module().count("tpu_custom_call")


@pytest.mark.lowering
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gate", GATES)
def test_fused_chunk_exports_for_tpu(gate, layout):
    forward, train, forward_structs, train_structs = _problem(gate, layout)
    assert _mosaic_calls(export_for_tpu(forward, *forward_structs)) == len(FORWARD_KERNELS)
    assert _mosaic_calls(export_for_tpu(train, *train_structs)) == len(TRAINING_KERNELS)


VMAP_SIZE = 2


@pytest.mark.lowering
def test_fused_chunk_vmap_exports_for_tpu():
    _, train, _, train_structs = _problem("g")
    structs = [jax.ShapeDtypeStruct((VMAP_SIZE, *s.shape), s.dtype) for s in train_structs]
    assert _mosaic_calls(export_for_tpu(jax.vmap(train), *structs)) == len(TRAINING_KERNELS)


@pytest.mark.tpu_compile
@pytest.mark.parametrize("chip", ["v5e", "v6e"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gate", GATES)
def test_fused_chunk_compiles_for_tpu(gate, layout, chip):
    forward, train, forward_structs, train_structs = _problem(gate, layout)
    forward_report = compile_for_tpu(forward, forward_structs, chip=chip)
    report = compile_for_tpu(train, train_structs, chip=chip)
    print(f"\nfused_chunk {gate} {layout} forward, {forward_report.summary()}")
    print(f"fused_chunk {gate} {layout} training step, {report.summary()}")
    assert tuple(kernel.name for kernel in forward_report.kernels) == FORWARD_KERNELS
    assert sorted(kernel.name for kernel in report.kernels) == sorted(TRAINING_KERNELS)
    bound = VMEM_BUDGET if layout == "fixed" else VARLEN_VMEM_BOUND
    for kernel in (*forward_report.kernels, *report.kernels):
        assert 0 < kernel.scoped_vmem_bytes <= bound, kernel
        assert kernel.flops and kernel.bytes_accessed, kernel
