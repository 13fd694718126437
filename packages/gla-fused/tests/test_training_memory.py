"""Memory evidence of the fused implementations: one training step (forward + backward of
`sum(o * do)`, h0/ht) of simple_gla with a g_gamma gate at B=2, T=4096, H=16, K=V=128 bf16,
compiled for a compile-only v6e with `xla`, `chunk`, `fused_chunk` and `fused_g_gamma`.

Prints XLA's temp memory and every kernel's scoped VMEM side by side (`nox -s tpu_compile`
runs pytest with `-s`). `fused_g_gamma` keeps no per-chunk state, gate or attention tensor in
HBM, so its temp memory must be below that of `chunk` and of `xla`.
"""

from __future__ import annotations

import pytest

from gla_core.cost import attention_problem, training_step_fn, training_structs
from gla_core.kit import CompileReport, compile_for_tpu

IMPLEMENTATIONS = ("xla", "chunk", "fused_chunk", "fused_g_gamma")


def side_by_side(reports: dict[str, CompileReport]) -> str:
    """One line per implementation: temp MiB, then each kernel's scoped VMEM KiB."""
    width = max(map(len, reports))
    lines = [f"{'impl':<{width}}  temp MiB  scoped VMEM per kernel (KiB)"]
    for name, report in reports.items():
        kernels = ", ".join(f"{k.name} {k.scoped_vmem_bytes / 1024:.0f}" for k in report.kernels) or "(plain XLA)"
        lines.append(f"{name:<{width}}  {report.temp_bytes / 2**20:8.1f}  {kernels}")
    return "\n".join(lines)


@pytest.mark.tpu_compile
def test_training_step_temp_memory_side_by_side():
    problem = attention_problem("simple_gla", 2, 4096, 16, gate="g_gamma")
    structs = training_structs(problem)
    reports = {name: compile_for_tpu(training_step_fn(problem, name), structs, chip="v6e") for name in IMPLEMENTATIONS}
    print(f"\nsimple_gla training step, {problem.label}, v6e:\n{side_by_side(reports)}")
    temp = {name: report.temp_bytes for name, report in reports.items()}
    assert temp["fused_g_gamma"] < temp["chunk"], temp
    assert temp["fused_g_gamma"] < temp["xla"], temp
