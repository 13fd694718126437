"""The `chunk` implementations at production shapes for TPU: `jax.export` lowering and
libtpu compile-only compiles (v5e, v6e), forward and backward, fixed and varlen.

Shapes: B=2, T=4096, H=16, K=V=128 bf16 (fixed length) and B=1, T=8192, 8 packed
sequences (varlen, `cu_seqlens` traced); gates g, g_gamma and gk; with h0 and final state.
The training step is `grad(sum(o * do) + sum(final_state))` over every differentiable
input, and also returns o, so every kernel is in it: on the token-major kernels (fixed length, g
or gk) and for a per-key or broadcast scalar gate with K and V in one block the forward and one
fused backward, otherwise (bfloat16 d g_gamma) the forward and four split backward kernels. Compile tests print
each kernel's scoped VMEM (`pytest -s`) and check it fits the chip's default scoped VMEM limit, or
for the token-major kernels, which set their own, `KERNEL_VMEM_BUDGET_BYTES`.
Under `jax.vmap` the kernels fold the mapped axis into B, so a vmapped training step exports
with the same Mosaic calls (a mapped cu_seqlens runs them in a loop over the mapped elements).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import gla_core
from gla_core.kit import DEFAULT_SCOPED_VMEM_BYTES, KERNEL_VMEM_BUDGET_BYTES, compile_for_tpu, export_for_tpu

BATCH, SEQ_LEN, HEADS, DIM = 2, 4096, 16, 128
VARLEN_SEQ_LEN, VARLEN_SEQUENCES = 8192, 8
# The Mosaic kernels of a training step, per gate kind.
SPLIT_BACKWARD = {"chunk_fwd_h", "chunk_bwd_dh", "chunk_bwd_dv", "chunk_bwd_dqkg"}
FUSED_BACKWARD = {"chunk_fwd", "chunk_bwd"}
KERNELS = {
    ("g", "fixed"): FUSED_BACKWARD,  # token-major
    ("g", "varlen"): FUSED_BACKWARD,  # the scalar gate broadcast over the keys
    # bfloat16 d g_gamma needs float32 products: head-major
    ("g_gamma", "fixed"): {"chunk_fwd", *SPLIT_BACKWARD},
    ("g_gamma", "varlen"): {"chunk_fwd", *SPLIT_BACKWARD},
    ("gk", "fixed"): FUSED_BACKWARD,  # token-major
    ("gk", "varlen"): FUSED_BACKWARD,
}
# The token-major kernels take all heads per grid step and ask for their own scoped VMEM limit
# (g_gamma: its forward alone; its training step differentiates g_gamma and takes the head-major kernels).
TOKEN_MAJOR = {("g", "fixed"), ("g_gamma", "fixed"), ("gk", "fixed")}
# The step kernels of packed calls (per-key or broadcast gate) take several chunks per grid step and
# ask for the same limit.
OWN_VMEM_LIMIT = TOKEN_MAJOR | {("gk", "varlen"), ("g", "varlen")}
GATES = ("g", "g_gamma", "gk")
LAYOUTS = ("fixed", "varlen")


def _problem(gate: str, layout: str):
    """(forward, training step, argument structs) for one gate kind and layout."""
    op = "gla" if gate == "gk" else "simple_gla"
    batch, seq_len = (BATCH, SEQ_LEN) if layout == "fixed" else (1, VARLEN_SEQ_LEN)
    num_states = batch if layout == "fixed" else VARLEN_SEQUENCES
    bf16 = jnp.bfloat16
    gate_shapes = {"g": ((batch, seq_len, HEADS), bf16), "g_gamma": ((HEADS,), jnp.float32)}
    gate_shapes["gk"] = ((batch, seq_len, HEADS, DIM), bf16)
    structs = [
        jax.ShapeDtypeStruct((batch, seq_len, HEADS, DIM), bf16),  # q
        jax.ShapeDtypeStruct((batch, seq_len, HEADS, DIM), bf16),  # k
        jax.ShapeDtypeStruct((batch, seq_len, HEADS, DIM), bf16),  # v
        jax.ShapeDtypeStruct(*gate_shapes[gate]),
        jax.ShapeDtypeStruct((num_states, HEADS, DIM, DIM), jnp.float32),  # initial_state
        jax.ShapeDtypeStruct((batch, seq_len, HEADS, DIM), bf16),  # do
    ]
    if layout == "varlen":
        structs.append(jax.ShapeDtypeStruct((VARLEN_SEQUENCES + 1,), jnp.int32))

    def forward(q, k, v, gate_value, initial_state, cu_seqlens=None):
        return gla_core.dispatch(
            op,
            q,
            k,
            v,
            **{gate: gate_value},
            initial_state=initial_state,
            output_final_state=True,
            cu_seqlens=cu_seqlens,
            impl="chunk",
        )

    def train(q, k, v, gate_value, initial_state, do, cu_seqlens=None):
        def loss(*differentiable):
            o, final_state = forward(*differentiable, cu_seqlens)
            return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(final_state), o

        grads, o = jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, gate_value, initial_state)
        return o, grads

    forward_structs = structs[:5] + structs[6:]
    return forward, train, forward_structs, structs


def _mosaic_calls(exported) -> int:
    return exported.mlir_module().count("tpu_custom_call")


@pytest.mark.lowering
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gate", GATES)
def test_chunk_exports_for_tpu(gate, layout):
    forward, train, forward_structs, train_structs = _problem(gate, layout)
    assert _mosaic_calls(export_for_tpu(forward, *forward_structs)) == 1  # chunk_fwd
    assert _mosaic_calls(export_for_tpu(train, *train_structs)) >= len(KERNELS[gate, layout])


VMAP_SIZE = 2


@pytest.mark.lowering
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gate", ("g", "gk"))
def test_chunk_vmap_exports_for_tpu(gate, layout):
    _, train, _, train_structs = _problem(gate, layout)
    mapped = lambda struct: jax.ShapeDtypeStruct((VMAP_SIZE, *struct.shape), struct.dtype)
    # every array mapped except cu_seqlens (shared boundaries: the kernels fold the mapped axis into B)
    in_axes = tuple(None if i == 6 else 0 for i in range(len(train_structs)))
    structs = [s if axis is None else mapped(s) for s, axis in zip(train_structs, in_axes, strict=True)]
    assert _mosaic_calls(export_for_tpu(jax.vmap(train, in_axes=in_axes), *structs)) >= len(KERNELS[gate, layout])


@pytest.mark.tpu_compile
@pytest.mark.parametrize("chip", sorted(DEFAULT_SCOPED_VMEM_BYTES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gate", GATES)
def test_chunk_compiles_for_tpu(gate, layout, chip):
    _, train, _, structs = _problem(gate, layout)
    report = compile_for_tpu(train, structs, chip=chip)
    print(f"\nchunk {gate} {layout} training step, {report.summary()}")
    assert {kernel.name for kernel in report.kernels} == KERNELS[gate, layout]
    limit = KERNEL_VMEM_BUDGET_BYTES if (gate, layout) in OWN_VMEM_LIMIT else DEFAULT_SCOPED_VMEM_BYTES[chip]
    for kernel in report.kernels:
        assert 0 < kernel.scoped_vmem_bytes <= limit, kernel


@pytest.mark.tpu_compile
@pytest.mark.parametrize("chip", sorted(DEFAULT_SCOPED_VMEM_BYTES))
@pytest.mark.parametrize("gate", GATES)
def test_chunk_forward_alone_compiles_for_tpu(gate, chip):
    """A forward without the VJP takes more chunks per grid step on the token-major kernels."""
    forward, _, structs, _ = _problem(gate, "fixed")
    report = compile_for_tpu(forward, structs, chip=chip)
    print(f"\nchunk {gate} fixed forward, {report.summary()}")
    assert [kernel.name for kernel in report.kernels] == ["chunk_fwd"]
    limit = KERNEL_VMEM_BUDGET_BYTES if (gate, "fixed") in TOKEN_MAJOR else DEFAULT_SCOPED_VMEM_BYTES[chip]
    assert 0 < report.kernels[0].scoped_vmem_bytes <= limit, report.kernels[0]
