"""`gla cost` rows survive a JSON round trip, and a partial run replaces only what it measured."""

from __future__ import annotations

from gla_core import cost_store
from gla_core.cost import CostRow, production_problems, render_markdown
from gla_core.cost_decode import DecodeRow, merge_decode
from gla_core.cycles import CycleFit
from gla_core.static_profile import HBM_BANDWIDTH
from gla_core.tpu_checks import CompileReport, KernelReport


def _row(problem, impl: str, chip: str, temp: int) -> CostRow:
    kernel = KernelReport("chunk_fwd_h", 320 * 1024, flops=10**9, transcendentals=10**6, bytes_accessed=10**8)
    forward = CompileReport(chip, temp // 2, (kernel,))
    training = CompileReport(chip, temp, (kernel, KernelReport("chunk_bwd_dh", 1024)))
    cycles = (("fwd", CycleFit("chunk_fwd_h", 1519.0, 410.5, ((256, 106607), (512, 211695)))),)
    return CostRow(problem, impl, chip, forward, training, None, cycles if chip == "v6e" else ())


def test_rows_round_trip_through_json(tmp_path):
    problems = production_problems()
    rows = [
        _row(problems[0], "chunk", "v6e", 3 * 2**20),
        CostRow(problems[3], "chunk", "v5e", None, None, "compile failed: RuntimeError: boom"),
    ]
    path = cost_store.json_path(tmp_path / "report.md")
    assert path.name == "report.json"
    cost_store.save_rows(rows, path)
    loaded = cost_store.load_rows(path)
    assert loaded == rows
    assert render_markdown(loaded) == render_markdown(rows)


def test_partial_run_replaces_only_the_measured_op_and_chip():
    problems = production_problems()
    simple, kda = problems[0], problems[3]
    kept = [_row(simple, "chunk", "v6e", 1), _row(simple, "chunk", "v5e", 2), _row(kda, "chunk", "v6e", 3)]
    measured = [_row(simple, "chunk", "v6e", 4), _row(simple, "fused_chunk", "v6e", 5)]
    merged = cost_store.merge_rows(kept, measured, problems)
    temps = [(row.problem.op, row.implementation, row.chip, row.training.temp_bytes) for row in merged]
    assert temps == [
        ("simple_gla", "chunk", "v5e", 2),
        ("simple_gla", "chunk", "v6e", 4),
        ("simple_gla", "fused_chunk", "v6e", 5),
        ("kda", "chunk", "v6e", 3),
    ]


def test_missing_store_is_empty(tmp_path):
    assert cost_store.load_rows(tmp_path / "absent.json") == []


def _decode_row(op: str, cycles: int) -> DecodeRow:
    return DecodeRow(op, f"{op} decode", "v6e", {"gla_decode": cycles}, 1.863e9, 330 * 2**20, 2**20, 0)


def test_decode_rows_round_trip_and_render_against_their_floor(tmp_path):
    rows = [_decode_row("simple_gla", 600_000), _decode_row("kda", 800_000)]
    path = tmp_path / "report.json"
    cost_store.save_rows([], path, rows)
    assert cost_store.load_decode_rows(path) == rows
    assert cost_store.load_rows(path) == []
    table = [line for line in render_markdown([], rows).splitlines() if line.startswith("| kda ")]
    seconds, floor = 800_000 / 1.863e9, 330 * 2**20 / HBM_BANDWIDTH["v6e"]
    assert table == [
        f"| kda | v6e | gla_decode 800,000 | {seconds * 1e6:.0f} us | {floor * 1e6:.0f} us | {seconds / floor:.2f} "
        "| 1.0 | 0.0 |"
    ]


def test_partial_decode_run_replaces_only_its_ops():
    kept = [_decode_row("simple_gla", 1), _decode_row("gla", 2), _decode_row("kda", 3)]
    merged = merge_decode(kept, [_decode_row("gla", 4)])
    assert [(row.op, row.kernel_cycles["gla_decode"]) for row in merged] == [("simple_gla", 1), ("gla", 4), ("kda", 3)]
