"""The rows of `gla cost` as JSON next to the report, so one op can be re-measured alone.

`gla cost --output docs/perf/tpu-cost.md` also writes `docs/perf/tpu-cost.json`. A later run
restricted with `--op`/`--chip` replaces only the rows it measured and renders the report from
all rows, so the markdown always describes every op. A run without `--op` replaces everything.
The serving decode rows (`gla_core.cost_decode`) are kept beside them under "decode".
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence

from gla_core.cost import CostRow, attention_problem
from gla_core.cost_decode import DecodeRow
from gla_core.cycles import CycleFit
from gla_core.tpu_checks import CompileReport, KernelReport

FORMAT_VERSION = 1


def json_path(report_path: str | pathlib.Path) -> pathlib.Path:
    """Where the rows of the report at `report_path` are kept (same name, `.json`)."""
    return pathlib.Path(report_path).with_suffix(".json")


def _report_to_dict(report: CompileReport | None) -> dict | None:
    return None if report is None else dataclasses.asdict(report)


def _report_from_dict(data: dict | None) -> CompileReport | None:
    if data is None:
        return None
    kernels = tuple(KernelReport(**kernel) for kernel in data["kernels"])
    return CompileReport(data["chip"], data["temp_bytes"], kernels)


def row_to_dict(row: CostRow) -> dict:
    """A JSON-ready dict of one row (the problem by the arguments that rebuild it)."""
    return {
        "problem": row.problem.spec,
        "implementation": row.implementation,
        "chip": row.chip,
        "forward": _report_to_dict(row.forward),
        "training": _report_to_dict(row.training),
        "note": row.note,
        "cycles": [
            {"stage": stage, **dataclasses.asdict(fit), "points": [list(p) for p in fit.points]}
            for stage, fit in row.cycles
        ],
    }


def row_from_dict(data: dict, problems: dict) -> CostRow:
    """The row of `row_to_dict`; `problems` caches rebuilt problems so rows share them."""
    key = json.dumps(data["problem"], sort_keys=True)
    if key not in problems:
        problems[key] = attention_problem(**data["problem"])
    cycles = tuple(
        (c["stage"], CycleFit(c["kernel"], c["intercept"], c["slope"], tuple(tuple(p) for p in c["points"])))
        for c in data["cycles"]
    )
    return CostRow(
        problems[key],
        data["implementation"],
        data["chip"],
        _report_from_dict(data["forward"]),
        _report_from_dict(data["training"]),
        data["note"],
        cycles,
    )


def save_rows(rows: Sequence[CostRow], path: str | pathlib.Path, decode_rows: Sequence[DecodeRow] = ()) -> None:
    """Writes the rows (and the decode rows) as JSON."""
    document = {
        "format": FORMAT_VERSION,
        "rows": [row_to_dict(row) for row in rows],
        "decode": [dataclasses.asdict(row) for row in decode_rows],
    }
    pathlib.Path(path).write_text(json.dumps(document, indent=1) + "\n")


def _document(path: pathlib.Path) -> dict:
    document = json.loads(path.read_text())
    if document.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: expected cost rows of format {FORMAT_VERSION}, got {document.get('format')!r}")
    return document


def load_rows(path: str | pathlib.Path) -> list[CostRow]:
    """The rows saved at `path`; an empty list when there is no file."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    problems: dict = {}
    return [row_from_dict(data, problems) for data in _document(path)["rows"]]


def load_decode_rows(path: str | pathlib.Path) -> list[DecodeRow]:
    """The decode rows saved at `path`; an empty list when there is no file or none was saved."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    return [DecodeRow(**data) for data in _document(path).get("decode", [])]


def merge_rows(kept: Sequence[CostRow], measured: Sequence[CostRow], order: Sequence) -> list[CostRow]:
    """`kept` rows not re-measured, plus `measured`, ordered by problem (as in `order`) then
    implementation and chip in measurement order."""
    measured_keys = {(row.problem.spec["op"], row.chip) for row in measured}
    rows = [r for r in kept if (r.problem.spec["op"], r.chip) not in measured_keys] + list(measured)
    specs = [json.dumps(p.spec, sort_keys=True) for p in order]

    def position(row: CostRow) -> int:
        spec = json.dumps(row.problem.spec, sort_keys=True)
        return specs.index(spec) if spec in specs else len(specs)

    return sorted(rows, key=position)
