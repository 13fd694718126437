"""The `gla` command line: list, explain, demo and bench, on fake or oracle-backed implementations."""

from __future__ import annotations

import dataclasses

import pytest

from gla_core import cli
from gla_core.demo import SCENARIOS, run_demo
from gla_core.errors import PluginWarning
from gla_core.registry import reset_default_registry
from gla_ref import recurrent


@pytest.fixture
def oracle_backed(install_registry, fake_impl, plugin_of):
    """simple_gla served by a correct implementation (the recurrence), a wrong one and `reference`."""

    def correct(args):
        gates = dict(g=args.g, g_gamma=args.g_gamma, initial_state=args.initial_state, cu_seqlens=args.cu_seqlens)
        o, ht = recurrent.simple_gla(
            args.q, args.k, args.v, scale=args.scale, output_final_state=args.output_final_state, **gates
        )
        return o.astype(args.v.dtype), ht

    def wrong(args):
        o, ht = correct(args)
        return o * 1.01, ht

    make = lambda name, priority, fn: dataclasses.replace(fake_impl(name, priority), fn=fn)
    install_registry(
        plugin_of(make("good", 50, correct), make("bad", 20, wrong), make("reference", 0, correct)),
    )


def test_list_shows_implementations_and_failures(fake_entry_points, good_plugin, restore_registry, capsys):
    fake_entry_points(xla=good_plugin("xla", 50), broken="raise ImportError('no libfoo')")
    reset_default_registry(None)
    with pytest.warns(PluginWarning, match="no libfoo"):
        assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "simple_gla" in out and "xla" in out and "xla-package" in out
    assert "plugin 'broken' failed to load" in out and "ImportError: no libfoo" in out
    assert "ops without implementation: gla" in out


def test_explain_prints_every_candidate(install_registry, fake_impl, plugin_of, capsys):
    install_registry(
        plugin_of(fake_impl("chunk", 100, backends={"tpu"}, interpretable=True), fake_impl("xla", 50)),
    )
    assert (
        cli.main(["explain", "simple_gla", "-T", "100", "--varlen", "3", "--h0", "--ht", "--gates", "g,g_gamma"]) == 0
    )
    out = capsys.readouterr().out
    assert "varlen N=3" in out and "gates=g+g_gamma" in out
    assert "declined: runs on tpu" in out and "interpret=True" in out
    assert "chosen: xla" in out
    assert cli.main(["explain", "simple_gla", "--backend", "tpu"]) == 0
    assert "chosen: chunk" in capsys.readouterr().out


def test_explain_reports_bad_shapes_as_errors(install_registry, fake_impl, plugin_of, capsys):
    install_registry(plugin_of(fake_impl("xla", 50)))
    assert cli.main(["explain", "simple_gla", "--varlen", "2", "-B", "2"]) == 2
    assert "ShapeError" in capsys.readouterr().err


def test_demo_checks_the_chosen_implementation_against_the_oracle(oracle_backed):
    table, passed = run_demo(timing=False, ops=("simple_gla",))
    assert passed
    assert table.count("good") == len([s for s in SCENARIOS if s.op == "simple_gla"])
    assert "bad" not in table


def test_demo_marks_a_wrong_implementation_as_failed(oracle_backed):
    table, passed = run_demo(run_all=True, timing=False, ops=("simple_gla",))
    assert not passed
    bad_rows = [line for line in table.splitlines() if " bad " in line]
    assert bad_rows and all("FAIL" in line for line in bad_rows)
    assert all("ok" in line for line in table.splitlines() if " good " in line)


def test_demo_times_against_reference(oracle_backed, monkeypatch):
    monkeypatch.setattr("gla_core.demo.SCENARIOS", SCENARIOS[:1])
    table, passed = run_demo(timing=True, ops=("simple_gla",))
    assert passed and " ms" in table and "x faster" in table


def test_bench_times_every_accepting_implementation(oracle_backed, capsys, monkeypatch):
    monkeypatch.setattr("gla_core.bench.PROBLEM", dict(batch=1, num_heads=1, key_dim=8, value_dim=8))
    assert cli.main(["bench", "--op", "simple_gla", "--seq-lens", "16", "32"]) == 0
    out = capsys.readouterr().out
    for name in ("good", "bad", "reference"):
        assert out.count(f" {name} ") == 4  # two T x two stages
    assert "1.00x" in out


def test_cost_measures_the_chosen_problems_and_writes_report_and_rows(monkeypatch, tmp_path, capsys):
    from gla_core import cost_measure

    calls = {}

    def measure(problems, chips, **options):
        calls.update(problems=[p.label for p in problems], chips=chips, **options)
        kernel = cost_measure.KernelEstimate("chunk_fwd", 16, 10**6, 2**20, "scaled", ((512, 62_500), (1024, 125_000)))
        row = cost_measure.ProgramRow(problems[0].spec, problems[0].label, "fwd", "v6e", "chunk", False, 1.9e9)
        return {"v6e": 1.9e9}, [dataclasses.replace(row, argument_bytes=2**27, output_bytes=2**27, kernels=(kernel,))]

    monkeypatch.setattr(cli, "_require", lambda *args: None)
    monkeypatch.setattr(cost_measure, "measure", measure)
    output = tmp_path / "tpu-cost.md"
    arguments = ["--op", "kda", "--chip", "v6e", "--no-decode", "--jobs", "1", "--full-shape-budget", "4"]
    assert cli.main(["cost", *arguments, "--output", str(output)]) == 0
    assert calls["problems"][:2] == ["B=2 T=4096 H=16 K=V=128 bf16, h0/ht", "B=1 T=8192 H=32 K=V=128 bf16, h0/ht"]
    assert calls["chips"] == ("v6e",) and calls["jobs"] == 1 and calls["memory_budget"] == 12 * 2**30
    assert calls["full_shape_budget"] == 4 * 2**30
    assert calls["peered"] == [calls["problems"][0]]  # the peers beside kda's production shape only
    report = output.read_text()
    assert "| kda | B=2 T=4096 H=16 K=V=128 bf16, h0/ht | chunk | fwd | v6e | 526 us |" in report
    assert "full-shape budget 4 GiB" in report and "jax " in report
    assert output.with_suffix(".json").exists()


def test_cost_peers_only_measures_the_peers_beside_their_problem_and_keeps_our_rows(monkeypatch, tmp_path):
    from gla_core import cost_measure, cost_store

    calls = {}

    def measure(problems, chips, **options):
        calls.update(problems=[p.label for p in problems], **options)
        problem = next(p for p in problems if p.label in options["peered"])
        row = cost_measure.ProgramRow(problem.spec, problem.label, "fwd", "v6e", "atomic_ops", True, 1.9e9)
        return {"v6e": 1.9e9}, [dataclasses.replace(row, argument_bytes=2**27, output_bytes=2**27)]

    monkeypatch.setattr(cli, "_require", lambda *args: None)
    monkeypatch.setattr(cost_measure, "measure", measure)
    monkeypatch.setattr("gla_core.cost_decode.measure_decode", lambda *args: pytest.fail("decode measured"))
    label = "B=2 T=4096 H=16 K=V=128 bf16, h0/ht"
    ours = cost_measure.ProgramRow({"op": "kda"}, label, "fwd", "v6e", "chunk", False, 1.9e9)
    ours = dataclasses.replace(ours, argument_bytes=2**27, output_bytes=2**27)
    output = tmp_path / "tpu-cost.md"
    cost_store.save(cost_store.Stored({"v6e": 1.9e9}, (ours,), ()), cost_store.json_path(str(output)))
    assert cli.main(["cost", "--op", "kda", "--chip", "v6e", "--peers-only", "--output", str(output)]) == 0
    assert calls["ours"] is False and calls["peered"] == [label]
    rows = cost_store.load(cost_store.json_path(str(output))).rows
    assert {(row.implementation, row.peer) for row in rows} == {("chunk", False), ("atomic_ops", True)}


def test_cost_peers_only_and_no_peers_exclude_each_other(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_require", lambda *args: None)
    with pytest.raises(SystemExit):
        cli.main(["cost", "--peers-only", "--no-peers"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_cost_refuses_a_full_shape_budget_above_the_memory_budget(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_require", lambda *args: None)
    assert cli.main(["cost", "--op", "gla", "--no-decode", "--memory-budget", "6", "--full-shape-budget", "8"]) == 2
    assert "full_shape_budget: expected 0 to the memory budget (6 GiB), got 8 GiB" in capsys.readouterr().err


def test_cost_keeps_the_rows_measured_before_a_run_stops(monkeypatch, tmp_path):
    from gla_core import cost_measure, cost_store
    from gla_core.static_profile import ProfileError

    def measure(problems, chips, *, measured, **options):
        row = cost_measure.ProgramRow(problems[0].spec, problems[0].label, "fwd", "v6e", "chunk", False, 1.9e9)
        measured({"v6e": 1.9e9}, [row])
        raise ProfileError("calibration compile failed: killed")

    monkeypatch.setattr(cli, "_require", lambda *args: None)
    monkeypatch.setattr(cost_measure, "measure", measure)
    output = tmp_path / "tpu-cost.md"
    assert cli.main(["cost", "--op", "gla", "--chip", "v6e", "--no-decode", "--output", str(output)]) == 2
    (row,) = cost_store.load(cost_store.json_path(output)).rows
    assert row.op == "gla" and not output.exists()
