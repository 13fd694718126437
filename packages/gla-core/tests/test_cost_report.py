"""gla_core.cost_report: the markdown of the TPU cost report from measured rows: targets, the summary
and kernel tables, the scaling's validation and the caveat that these are compiler estimates."""

from __future__ import annotations

import dataclasses

from gla_core.cost_measure import KernelEstimate, ProgramRow
from gla_core.cost_report import kernel_lines, render, scaling_errors, summary_lines, target_notes
from gla_core.static_profile import HBM_BANDWIDTH

CLOCK = 1e9
GIB, MIB = 2**30, 2**20
KDA = {"op": "kda", "batch": 2, "seq_len": 4096, "heads": 16, "dim": 128, "gate": "g", "sequences": None}
LABEL = "B=2 T=4096 H=16 K=V=128 bf16, h0/ht"
# A compiled kernel whose probes scale to 1% above it, and a scaled one too big to compile at the full shape.
PROBES = ((512, 6_000), (1024, 12_000))
FULL = KernelEstimate("chunk_fwd", 64, 100_000, 2 * MIB, "full", PROBES, 101_000, GIB, 20.0, 1.5 * GIB, 25.0)
SCALED = KernelEstimate(
    "chunk_bwd", 64, 400_000, 4 * MIB, "scaled", ((512, 25_000), (1024, 50_000)), 400_000, 0, 0, 20 * GIB, 300.0, "big"
)


def _row(stage="train", *, impl="chunk", peer=False, kernels=(FULL, SCALED), xla=0, temp=0, problem=KDA):
    # 100 MiB in and out: a floor of 200 MiB, 128 us on v6e.
    return ProgramRow(problem, LABEL, stage, "v6e", impl, peer, CLOCK, 100 * MIB, 100 * MIB, temp, xla, kernels)


def test_time_floor_and_ratio_come_from_cycles_clock_and_memory_analysis():
    row = _row()
    assert row.pallas_cycles == 500_000 and row.seconds == 500_000 / CLOCK
    assert row.floor_seconds == 200 * MIB / HBM_BANDWIDTH["v6e"]
    assert row.ratio == row.seconds / row.floor_seconds


def test_targets_per_op_and_stage_and_against_peers():
    ours = _row(xla=30 * MIB)
    faster_peer = _row(impl="atomic_ops", peer=True, kernels=(dataclasses.replace(FULL, cycles=10),))
    notes = target_notes(ours, [ours, faster_peer, _row("fwd", impl="atomic_gdn2", peer=True)])
    assert notes == ["ratio <= 5: ok", "XLA bytes <= 0.1 floor: **missed**", "faster than atomic_ops: **missed**"]
    assert target_notes(faster_peer) == []
    fused = _row(impl="fused_g_gamma", temp=101 * MIB, problem={**KDA, "op": "simple_gla", "gate": "g_gamma"})
    assert "temp <= 100 MiB: **missed**" in target_notes(fused)


def test_summary_says_how_kernels_were_obtained_and_which_failed():
    failed = dataclasses.replace(SCALED, method="failed", cycles=0, note="libtpu aborted")
    rows = [_row(), _row("fwd", kernels=(FULL, failed)), dataclasses.replace(_row("fwd"), kernels=(), note="no trace")]
    complete, incomplete, broken = summary_lines(rows)[2:]
    assert "| 500 us | 128 us | 3.91 | 0.0 (0.00) | 0.0 | 1 full, 1 scaled | ratio <= 5: ok;" in complete
    assert "| incomplete (chunk_bwd failed) | 128 us | - |" in incomplete and "1 full, 1 failed" in incomplete
    assert "| no trace |" in broken


def test_kernel_lines_show_measured_and_predicted_compiles():
    _, _, full, scaled = kernel_lines([_row()])
    assert "| chunk_fwd | 64 | 100,000 | full | 512: 6,000, 1024: 12,000 | 1.0 GiB, 20 s | 2,048 |" in full
    assert "| chunk_bwd | 64 | 400,000 | scaled |" in scaled and "| ~20.0 GiB, ~300 s | 4,096 | big |" in scaled


def test_scaling_errors_of_kernels_compiled_at_the_full_shape():
    ((_, kernel, error),) = scaling_errors([_row()])
    assert kernel is FULL and abs(error - 0.01) < 1e-12


def test_report_says_these_are_estimates_and_shows_calibration_scaling_and_validation():
    text = render({"v6e": 1.863e9, "v5e": 1.5e9}, [_row("fwd"), _row()], full_shape_budget=12 * GIB)
    assert "Nothing here was measured on a TPU" in text
    assert "- v6e: 1.863 GHz" in text and "- v5e: 1.500 GHz" in text
    assert "2 kernels were scaled, not compiled at the full shape (full-shape budget 12 GiB" in text
    assert "kda fwd chunk_bwd, kda train chunk_bwd" in text
    assert "2 kernels were compiled at the full shape and also scaled from their probes" in text
    assert "predicted peak memory came out 1.50 to 1.50 times the measured one" in text
    assert "| chunk_fwd | 100,000 | 101,000 | +1.00% | 1.00, 20 (predicted 1.50, 25) |" in text
    assert "| chunk_bwd_dqkg | 2,028,593 | 2,028,974 | +0.02% |" in text  # the one-time production-shape validation
    assert "tokamax" in text and "atomic_ops" in text
