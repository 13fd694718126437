"""`gla tune`: every TPU implementation's tuning options for one chip, by libtpu's static estimate.

For each implementation of an op that runs on TPU and declares options with `candidates`, one
option at a time (the others at their best so far, starting from the values calls on the chip take
today: its table row, its own or borrowed, over the declared defaults), the program (the forward or
the training step of `gla_core.cost.attention_problem`) is compiled for a compile-only device of the
chip with the value the option has and every other candidate, and the one with the smallest Pallas
static cycles wins (ties: the value it has, else the earlier candidate). The winners become the
chip's rows of the table of `gla_core.tuning`. These are compiler estimates, not TPU measurements.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from gla_core import tuning
from gla_core.registry import default_registry


@dataclasses.dataclass(frozen=True)
class Trial:
    """One compiled candidate: its implementation and options, and the Pallas static cycles of the
    program (None when the compile failed, with the error); `stage` names the program when it is not
    the swept one (the check that the chosen options compile the other stage too)."""

    implementation: str
    options: tuple[tuple[str, Any], ...]
    cycles: int | None
    error: str = ""
    stage: str | None = None


def tunable(op: str) -> list:
    """The implementations of `op` that run on TPU and have options with candidates."""
    return [
        record
        for record in default_registry().implementations(op)
        if "tpu" in record.backends and any(option.candidates for option in record.options)
    ]


def program_spec(op: str, chip: str, implementation: str, options: dict, *, batch, seq_len, heads, stage) -> dict:
    """The `gla_core.static_profile` spec of one trial (simple_gla with its per-step gate `g`)."""
    from gla_core.cost import attention_problem
    from gla_core.cost import program_spec as stage_spec

    problem = attention_problem(op, batch, seq_len, heads)
    return {**stage_spec(problem, stage, implementation, {implementation: options}), "chip": chip}


def static_cycles(spec: dict) -> int:
    """Pallas static cycles of the program `spec` describes (every kernel profiled in a program of
    its own, in subprocesses: a whole profiled program can take more memory than a small machine has)."""
    from gla_core.static_profile import profile_by_kernel

    return profile_by_kernel(spec).pallas_cycles


def starting_options(op: str, record, chip: str) -> dict[str, Any]:
    """The options a call of `record` on `chip` takes without options of its own: the declared
    defaults, with the chip's table row (its own or borrowed, `gla_core.tuning.tuned_defaults`) over
    them. The sweep starts there, so its choice never loses to them at its shape when they compile (a
    tie keeps them)."""
    options = {option.name: option.default for option in record.options}
    table, _ = tuning.tuned_defaults(op, record.name, chip)
    return {**options, **{name: value for name, value in table.items() if name in options}}


def sweep(
    op: str,
    chip: str,
    *,
    batch: int = 1,
    seq_len: int = 1024,
    heads: int = 16,
    stage: str = "train",
    measure: Callable[[dict], int] = static_cycles,
    progress: Callable[[Trial], None] = lambda trial: None,
) -> tuple[dict[str, dict[str, Any]], list[Trial]]:
    """Coordinate search of every tunable implementation of `op` on `chip`.

    Returns (the best options per implementation, every trial in order). `measure(spec)` gives the
    cycles of a trial's program and raises when it does not compile. The options chosen for `stage`
    must compile the other stage too (some options act in one of them only, e.g. the forward-only
    kernels' chunks per step): an implementation whose choice does not gets no row.
    """
    rows, trials, cache = {}, [], {}
    other_stage = "fwd" if stage == "train" else "train"

    def cycles_of(record, options: dict, program: str = stage) -> int | None:
        settings = tuple(sorted(options.items()))
        key = (record.name, settings, program)
        if key not in cache:
            spec = program_spec(
                op, chip, record.name, options, batch=batch, seq_len=seq_len, heads=heads, stage=program
            )
            checked = None if program == stage else program
            try:
                trial = Trial(record.name, settings, int(measure(spec)), stage=checked)
            except Exception as error:  # a candidate that does not compile loses; the sweep goes on
                trial = Trial(record.name, settings, None, f"{type(error).__name__}: {error}", stage=checked)
            cache[key] = trial.cycles
            trials.append(trial)
            progress(trial)
        return cache[key]

    for record in tunable(op):
        best = starting_options(op, record, chip)
        for option in (option for option in record.options if option.candidates):
            current = best[option.name]
            values = (current, *(value for value in option.candidates if value != current))
            scored = [(cycles_of(record, {**best, option.name: value}), value) for value in values]
            compiled = [(cycles, value) for cycles, value in scored if cycles is not None]
            if compiled:
                # On a tie the value it has stays: an option without effect in this program keeps
                # its default, and does not hide the effect of those swept after it.
                best[option.name] = min(compiled, key=lambda pair: (pair[0], pair[1] != current))[1]
        if cycles_of(record, best) is not None and cycles_of(record, best, other_stage) is not None:
            rows[record.name] = best
    return rows, trials


def render(op: str, chip: str, rows: dict, trials: list[Trial], clock_hz: float | None = None) -> str:
    """A markdown summary: every trial, and the chosen options."""
    lines = [
        f"## gla tune {op} --chip {chip}",
        "",
        "| implementation | options | static cycles | |",
        "|---|---|---|---|",
    ]
    for trial in trials:
        options = ", ".join(f"{name}={value}" for name, value in trial.options)
        chosen = rows.get(trial.implementation) == dict(trial.options) and trial.stage is None
        cycles = f"{trial.cycles:,}" if trial.cycles is not None else f"failed: {trial.error[:80]}"
        if trial.cycles is not None and clock_hz:
            cycles += f" ({trial.cycles / clock_hz * 1e6:.1f} us)"
        mark = "chosen" if chosen else (f"{trial.stage} check" if trial.stage else "")
        lines.append(f"| {trial.implementation} | {options} | {cycles} | {mark} |")
    return "\n".join(lines)
