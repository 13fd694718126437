"""`gla cost` rows kept as JSON next to the report: a round trip, and partial runs that replace only
what they measured."""

from __future__ import annotations

import dataclasses

from gla_core import cost_store
from gla_core.cost_decode import DecodeRow
from gla_core.cost_measure import KernelEstimate, ProgramRow

CLOCK = 1.863e9
GLA = {"op": "gla", "batch": 2, "seq_len": 4096, "heads": 16, "dim": 128, "gate": "g", "sequences": None}
KDA = {**GLA, "op": "kda"}
MIB = 2**20


def _row(problem: dict, stage: str, chip: str, cycles: int) -> ProgramRow:
    kernels = (
        KernelEstimate(
            "chunk_fwd", 256, cycles, 3 * MIB, "scaled", ((512, 9), (1024, 17)), cycles, 0, 0, 2**34, 9.5, "big"
        ),
        KernelEstimate("chunk_bwd", 256, 1000, MIB, "full", ((512, 60), (1024, 120)), 1010, 2**31, 3.0, 2**30, 2.0),
    )
    return ProgramRow(problem, "B=2 T=4096", stage, chip, "chunk", False, CLOCK, 100 * MIB, 100 * MIB, 0, 0, kernels)


def test_rows_round_trip_through_json(tmp_path):
    rows = (_row(GLA, "fwd", "v6e", 10**6), dataclasses.replace(_row(KDA, "train", "v5e", 1), note="compile failed: x"))
    decode = (DecodeRow("kda", "kda decode", "v6e", {"gla_decode": 5}, CLOCK, MIB, 0, 0),)
    stored = cost_store.Stored({"v6e": CLOCK}, rows, decode)
    path = cost_store.json_path(tmp_path / "report.md")
    assert path.name == "report.json"
    cost_store.save(stored, path)
    assert cost_store.load(path) == stored


def test_missing_or_old_store_is_empty(tmp_path):
    assert cost_store.load(tmp_path / "absent.json").rows == ()
    old = tmp_path / "old.json"
    old.write_text('{"format": 2, "rows": []}')
    assert cost_store.load(old) == cost_store.Stored({}, (), ())


def test_partial_run_replaces_only_the_measured_problem_and_chip():
    gla, kda = _row(GLA, "fwd", "v6e", 1), _row(KDA, "fwd", "v6e", 2)
    kept = cost_store.Stored({"v6e": 1.0}, (gla, _row(GLA, "fwd", "v5e", 3), kda), ())
    measured = cost_store.Stored({"v6e": CLOCK}, (_row(GLA, "fwd", "v6e", 4), _row(GLA, "train", "v6e", 5)), ())
    merged = cost_store.merge(kept, measured, [("gla", gla.label), ("kda", kda.label)])
    assert [(r.op, r.stage, r.chip, r.kernels[0].cycles) for r in merged.rows] == [
        ("gla", "fwd", "v6e", 4),
        ("gla", "train", "v6e", 5),
        ("gla", "fwd", "v5e", 3),
        ("kda", "fwd", "v6e", 2),
    ]
    assert merged.clocks == {"v6e": CLOCK}


def test_partial_run_without_peers_keeps_the_peer_rows():
    ours, peer = (
        _row(KDA, "fwd", "v6e", 1),
        dataclasses.replace(_row(KDA, "fwd", "v6e", 2), implementation="p", peer=True),
    )
    kept = cost_store.Stored({"v6e": CLOCK}, (ours, peer), ())
    measured = cost_store.Stored({"v6e": CLOCK}, (_row(KDA, "fwd", "v6e", 3),), ())
    merged = cost_store.merge(kept, measured, [("kda", ours.label)])
    assert [(r.implementation, r.peer, r.kernels[0].cycles) for r in merged.rows] == [
        ("chunk", False, 3),
        ("p", True, 2),
    ]
