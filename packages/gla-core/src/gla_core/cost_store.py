"""The rows of `gla cost` as JSON next to the report, so part of it can be re-measured alone.

`gla cost --output docs/perf/tpu-cost.md` also writes `docs/perf/tpu-cost.json`: the clocks, every
`ProgramRow` and the serving decode rows (`gla_core.cost_decode`). A later run restricted with
`--op`/`--chip` (or `--decode-only`) replaces only the rows it measured, and the markdown is rendered
from all rows, so it always describes everything.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence

from gla_core.cost_decode import DECODE_OPS, DecodeRow
from gla_core.cost_measure import KernelEstimate, ProgramRow
from gla_core.errors import InvalidArgumentError

FORMAT_VERSION = 3


@dataclasses.dataclass(frozen=True)
class Stored:
    """Everything the report is rendered from."""

    clocks: dict[str, float]
    rows: tuple[ProgramRow, ...]
    decode: tuple[DecodeRow, ...]


def json_path(report_path: str | pathlib.Path) -> pathlib.Path:
    """Where the rows of the report at `report_path` are kept (same name, `.json`)."""
    return pathlib.Path(report_path).with_suffix(".json")


def _row_from(data: dict) -> ProgramRow:
    kernels = tuple(KernelEstimate(**{**k, "probes": tuple(tuple(p) for p in k["probes"])}) for k in data["kernels"])
    return ProgramRow(**{**data, "kernels": kernels})


def save(stored: Stored, path: str | pathlib.Path) -> None:
    document = {
        "format": FORMAT_VERSION,
        "clocks": stored.clocks,
        "rows": [dataclasses.asdict(row) for row in stored.rows],
        "decode": [dataclasses.asdict(row) for row in stored.decode],
    }
    pathlib.Path(path).write_text(json.dumps(document, indent=1) + "\n")


def load(path: str | pathlib.Path) -> Stored:
    """What was saved at `path`; nothing when there is no file or it is of an older format (re-measure)."""
    path = pathlib.Path(path)
    if not path.exists():
        return Stored({}, (), ())
    document = json.loads(path.read_text())
    if document.get("format") != FORMAT_VERSION:
        return Stored({}, (), ())
    rows = tuple(_row_from(row) for row in document["rows"])
    return Stored(document["clocks"], rows, tuple(DecodeRow(**row) for row in document["decode"]))


def _problem(row: ProgramRow) -> tuple[str, str]:
    return row.op, row.label


def _program(row: ProgramRow) -> tuple:
    """What a measured row replaces: the rows of its problem, chip and implementation (all stages)."""
    return _problem(row), row.chip, row.implementation, row.peer


def merge(kept: Stored, measured: Stored, order: Sequence[tuple[str, str]]) -> Stored:
    """`kept` with the rows of every (problem, chip, implementation) that `measured` has replaced by
    its rows (a run without the peers keeps their rows), the decode rows of every (op, chip) it has
    likewise, and its clocks; rows in the order of `order` ((op, label) of every problem of the
    report), then by chip, ours before the peers'."""
    if not {_problem(row) for row in measured.rows} <= set(order):
        raise InvalidArgumentError("merge: a measured row's problem is not in the report's problem order")
    replaced = {_program(row) for row in measured.rows}
    kept_rows = [r for r in kept.rows if _program(r) not in replaced and _problem(r) in order]
    rows = kept_rows + list(measured.rows)
    chips = ("v6e", "v5e")
    rows.sort(key=lambda row: (order.index(_problem(row)), chips.index(row.chip), row.peer))
    decoded = {(row.op, row.chip) for row in measured.decode}
    decode = [row for row in kept.decode if (row.op, row.chip) not in decoded] + list(measured.decode)
    decode.sort(key=lambda row: (DECODE_OPS.index(row.op), row.chip))
    return Stored({**kept.clocks, **measured.clocks}, tuple(rows), tuple(decode))
