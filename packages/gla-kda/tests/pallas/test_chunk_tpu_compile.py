"""kda `chunk` compiles with Mosaic for compile-only v6e and v5e devices at production shapes.

Run with `nox -s tpu_compile`, or `python -m pytest -m tpu_compile <this file> -s` where jax[tpu] is installed;
each compile prints its `CompileReport.summary()`: XLA temp memory and each kernel's scoped
VMEM. Every kda kernel sets its scoped-VMEM limit to `KERNEL_VMEM_BUDGET_BYTES` (48 MiB: 3/4 of
v7x's 64 MiB per core; v5e and v6e have 128 MiB) in place of XLA's default
(`xla_tpu_scoped_vmem_limit_kib`: 16 MiB on v5e, 32 MiB on v6e), and must fit it.
"""

from __future__ import annotations

import pytest

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
