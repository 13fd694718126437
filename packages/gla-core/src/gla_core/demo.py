"""`gla demo`: every installed op, run through `dispatch` on this backend and checked against the
float64 oracle of gla-ref.

For each scenario (a realistic problem per op), the implementation dispatch chooses runs
forward and backward; the table shows the relative error (max|x - ref| / max|ref|) of the
output, the final state and every gradient against the float64 recurrence, whether each is
within the tolerance of gla-ref for the dtype, and the forward+backward time against the
`reference` implementation run in the same dtype. New implementations appear here as soon as
they are installed and win dispatch (or, with `--all`, as soon as they accept the call).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from gla_core.dispatch import dispatch, explain, implementations
from gla_core.errors import GlaError
from gla_core.progress import progress
from gla_core.timing import forward_backward_seconds


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One realistic problem: the op and the keyword arguments of `gla_ref.testing.make_case`."""

    op: str
    label: str
    case: dict[str, Any]


SCENARIOS = (
    Scenario(
        "simple_gla",
        "g, h0/ht",
        dict(
            batch=2,
            seq_len=512,
            num_heads=4,
            key_dim=64,
            value_dim=64,
            gates=("g",),
            initial_state=True,
            output_final_state=True,
        ),
    ),
    Scenario(
        "simple_gla",
        "g_gamma, varlen N=3",
        dict(
            batch=1,
            seq_len=600,
            num_heads=4,
            key_dim=64,
            value_dim=64,
            gates=("g_gamma",),
            cu_seqlens=[0, 37, 400, 600],
            output_final_state=True,
        ),
    ),
    Scenario(
        "gla",
        "gk, h0/ht",
        dict(batch=2, seq_len=512, num_heads=4, key_dim=64, value_dim=64, initial_state=True, output_final_state=True),
    ),
    Scenario(
        "kda",
        "gate+l2norm in kernel",
        dict(
            batch=2,
            seq_len=512,
            num_heads=4,
            key_dim=64,
            value_dim=64,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            initial_state=True,
            output_final_state=True,
        ),
    ),
    Scenario(
        "kda",
        "HV=2H, varlen N=3",
        dict(
            batch=1,
            seq_len=600,
            num_heads=2,
            num_value_heads=4,
            key_dim=64,
            value_dim=64,
            cu_seqlens=[0, 1, 300, 600],
            output_final_state=True,
        ),
    ),
    Scenario("kda_gate", "dt_bias", dict(batch=2, seq_len=512, num_heads=4, key_dim=64)),
)


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the demo table."""

    op: str
    label: str
    implementation: str
    errors: dict[str, float]
    tolerance: Any
    seconds: float | None
    reference_seconds: float | None
    failure: str | None = None

    @property
    def passed(self) -> bool:
        return self.failure is None and all(
            error <= (self.tolerance.output if name in ("o", "final_state", "gate") else self.tolerance.grad)
            for name, error in self.errors.items()
        )


def _runner(op: str, impl: str) -> Callable[..., Any]:
    return lambda **kwargs: dispatch(op, impl=impl, **kwargs)


def _implementations_to_run(scenario: Scenario, case, run_all: bool) -> list[str]:
    resolution = explain(scenario.op, **case.kwargs())
    if not run_all:
        return [resolution.chosen().name]
    accepted = [c.implementation.name for c in resolution.candidates if c.accepted]
    return [name for name in accepted if name != "reference"] or accepted


def run_scenario(scenario: Scenario, run_all: bool, timing: bool) -> list[Row]:
    """Runs one scenario with the chosen implementation (or every accepting one)."""
    from gla_ref import testing

    case = testing.make_case(scenario.op, **scenario.case)
    tolerance = testing.tolerance_for(case.dtype)

    def seconds_of(fn):
        return forward_backward_seconds(fn, case.inputs, case.options, case.differentiable) if timing else None

    reference_seconds = seconds_of(_runner(scenario.op, "reference"))
    rows = []
    for name in _implementations_to_run(scenario, case, run_all):
        fn = _runner(scenario.op, name)
        try:
            errors = testing.compare_with_oracle(fn, case)
            seconds = seconds_of(fn)
            rows.append(Row(scenario.op, scenario.label, name, errors, tolerance, seconds, reference_seconds))
        except (GlaError, ValueError, TypeError, RuntimeError) as error:
            failure = f"{type(error).__name__}: {error}".splitlines()[0]
            rows.append(Row(scenario.op, scenario.label, name, {}, tolerance, None, reference_seconds, failure))
    return rows


def _format_errors(row: Row) -> str:
    if row.failure:
        return row.failure
    return "  ".join(f"{name} {error:.1e}" for name, error in row.errors.items())


def format_table(rows: list[Row]) -> str:
    """The demo table: one line per (scenario, implementation)."""
    header = ("op", "case", "impl", "check", "time", "vs reference", "relative error vs float64 oracle")
    lines = []
    for row in rows:
        seconds = f"{row.seconds * 1e3:.0f} ms" if row.seconds is not None else "-"
        timed = row.seconds and row.reference_seconds
        ratio = f"{row.reference_seconds / row.seconds:.1f}x faster" if timed else "-"
        check = "ok" if row.passed else "FAIL"
        lines.append((row.op, row.label, row.implementation, check, seconds, ratio, _format_errors(row)))
    widths = [max(len(str(line[i])) for line in [header, *lines]) for i in range(len(header) - 1)]
    render = lambda line: "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=False)) + "  " + line[-1]
    return "\n".join([render(header), render((*("-" * w for w in widths), "-" * 32)), *map(render, lines)])


def installed_scenarios() -> list[Scenario]:
    """Scenarios of the ops that have at least one installed implementation besides `reference`."""
    ops = {impl.op for impl in implementations() if impl.name != "reference"}
    return [s for s in SCENARIOS if s.op in ops]


def run_demo(run_all: bool = False, timing: bool = True, ops: tuple[str, ...] | None = None) -> tuple[str, bool]:
    """Runs every installed scenario; returns the table and whether every check passed."""
    try:
        import gla_ref.testing  # noqa: F401
    except ImportError as error:
        raise SystemExit(
            f"gla demo compares with the float64 oracle of gla-ref: pip install gla-ref ({error})"
        ) from error
    scenarios = [s for s in installed_scenarios() if ops is None or s.op in ops]
    if not scenarios:
        raise SystemExit(
            "gla demo: no implementation besides `reference` is installed (pip install gla-simple gla-kda)"
        )
    rows = []
    for scenario in progress(scenarios, len(scenarios), label=lambda s: f"{s.op} ({s.label})"):
        rows.extend(run_scenario(scenario, run_all, timing))
    return format_table(rows), all(row.passed for row in rows)
