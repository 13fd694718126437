"""kda `chunk` compiles with Mosaic for compile-only v6e and v5e devices at production shapes.

Run with `nox -s tpu_compile`, or `python -m pytest -m tpu_compile <this file> -s` where jax[tpu] is installed;
each compile prints its `CompileReport.summary()`: XLA temp memory and each kernel's scoped
VMEM. Every kda kernel sets its scoped-VMEM limit to `KERNEL_VMEM_BUDGET_BYTES` (48 MiB: 3/4 of
v7x's 64 MiB per core; v5e and v6e have 128 MiB) in place of XLA's default
(`xla_tpu_scoped_vmem_limit_kib`: 16 MiB on v5e, 32 MiB on v6e), and must fit it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import gla_core
from gla_core.kit import KERNEL_VMEM_BUDGET_BYTES, compile_for_tpu

pytestmark = pytest.mark.tpu_compile


def _check(report, expected_kernels):
    print(report.summary())
    names = [kernel.name for kernel in report.kernels]
    for name in expected_kernels:
        assert name in names, f"{report.chip}: kernel {name} not in the compiled program ({names})"
    limit = KERNEL_VMEM_BUDGET_BYTES
    for kernel in report.kernels:
        assert kernel.scoped_vmem_bytes <= limit, (
            f"{report.chip}: {kernel.name} reserves {kernel.scoped_vmem_bytes} bytes of scoped VMEM, limit {limit}"
        )


@pytest.mark.parametrize("chip", ["v6e", "v5e"])
@pytest.mark.parametrize("shape", ["B1_T8192_H32", "B2_T4096_H16"])
def test_forward_compiles(production, shape, chip):
    report = compile_for_tpu(production["forward"], production["structs"](shape, False), chip=chip)
    _check(report, ("kda_intra", "kda_state"))


@pytest.mark.parametrize("chip", ["v6e", "v5e"])
@pytest.mark.parametrize("shape", ["B1_T8192_H32", "B2_T4096_H16"])
def test_backward_compiles(production, shape, chip):
    structs = production["structs"](shape, False, with_cotangent=True)
    report = compile_for_tpu(production["backward"], structs, chip=chip)
    _check(report, ("kda_intra", "kda_state", "kda_state_bwd", "kda_intra_bwd"))


@pytest.mark.parametrize("chip", ["v6e", "v5e"])
def test_varlen_training_step_compiles(production, chip):
    structs = production["structs"]("B2_T4096_H16", True, with_cotangent=True)
    report = compile_for_tpu(production["backward"], structs, chip=chip)
    _check(report, ("kda_intra", "kda_state", "kda_state_bwd", "kda_intra_bwd"))


def _packed_step_with_states(q, k, v, g, beta, h0, do, dht, cu_seqlens):
    """A packed training step with initial and final states: the gradients of
    sum(o * do) + sum(ht * dht) with respect to every input, h0 included."""

    def loss(q, k, v, g, beta, h0):
        o, ht = gla_core.dispatch(
            "kda",
            q,
            k,
            v,
            g=g,
            beta=beta,
            initial_state=h0,
            output_final_state=True,
            impl="chunk",
            cu_seqlens=cu_seqlens,
        )
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)) + jnp.sum(ht * dht)

    return jax.grad(loss, argnums=tuple(range(6)))(q, k, v, g, beta, h0)


@pytest.mark.parametrize("sequences", [4, 64], ids=["states_in_vmem", "states_by_dma"])
def test_packed_training_step_with_states_compiles(production, sequences):
    """Packed rows move their sequences' initial and final states (and their gradients) within VMEM
    when they are few, by DMA when they are many (`gla_kda.pallas.sequence_states.resident_states`):
    both compile for v6e at the production shape."""
    q, k, v, g, beta, do, _ = production["structs"]("B2_T4096_H16", True, with_cotangent=True)
    heads, key_dim, value_dim = v.shape[2], k.shape[3], v.shape[3]
    state = jax.ShapeDtypeStruct((sequences, heads, key_dim, value_dim), jnp.float32)
    cu_seqlens = jax.ShapeDtypeStruct((sequences + 1,), jnp.int32)
    report = compile_for_tpu(_packed_step_with_states, [q, k, v, g, beta, state, do, state, cu_seqlens], chip="v6e")
    _check(report, ("kda_intra", "kda_state", "kda_state_bwd", "kda_intra_bwd"))
