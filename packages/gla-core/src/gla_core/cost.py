"""`gla cost`: what the TPU compiler says each implementation costs, without a TPU.

For every implementation of each op that can run on TPU (the Pallas kernels and `xla`), at
production shapes, this compiles the forward and one training step (forward + backward of
`sum(o * do)`) for compile-only v5e and v6e devices and reports per Pallas kernel its
`pl.CostEstimate` (flops, transcendentals, bytes) and scoped VMEM, and per program XLA's temp
memory. It also gives the HBM floor of each problem: the bytes any implementation must move
(read every input, write every output; in the training step also read `do` and write every
gradient) divided by the chip's HBM bandwidth.

These are compiler estimates and lower bounds, not measurements on hardware.
Needs `jax[tpu]` (libtpu) for the compile-only devices: `nox -s cost`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from gla_core.cycles import kernel_cycles
from gla_core.dispatch import dispatch, explain
from gla_core.overrides import use
from gla_core.tpu_checks import CompileReport, compile_for_tpu

# HBM bandwidth per chip in bytes/s (public spec sheets).
HBM_BANDWIDTH = {"v5e": 819e9, "v6e": 1640e9}
CHIPS = ("v6e", "v5e")
REGENERATE = "`nox -s cost` (runs `gla cost --cycles --output docs/perf/tpu-cost.md`)"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One op at one production shape; arrays described by ShapeDtypeStructs."""

    op: str
    label: str
    arrays: tuple[jax.ShapeDtypeStruct, ...]
    keywords: dict[str, Any]
    differentiable: tuple[str, ...]  # keyword names (and "q", "k", "v"/"g") that get gradients
    spec: dict[str, Any]  # arguments of `attention_problem` that rebuild it (for other lengths)


def _struct(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def attention_problem(op: str, batch: int, seq_len: int, heads: int, dim: int = 128, gate: str = "g") -> Problem:
    """simple_gla/gla/kda at [batch, seq_len, heads, dim] bf16 with h0 and ht."""
    b, t, h, d = batch, seq_len, heads, dim
    arrays = (_struct(b, t, h, d), _struct(b, t, h, d), _struct(b, t, h, d))
    keywords: dict[str, Any] = {"initial_state": _struct(b, h, d, d, dtype=jnp.float32), "output_final_state": True}
    if op == "simple_gla":
        keywords[gate] = _struct(b, t, h, dtype=jnp.float32) if gate == "g" else _struct(h, dtype=jnp.float32)
    elif op == "gla":
        keywords["gk"] = _struct(b, t, h, d, dtype=jnp.float32)
    else:
        keywords.update(g=_struct(b, t, h, d, dtype=jnp.float32), beta=_struct(b, t, h, dtype=jnp.float32))
    differentiable = ("q", "k", "v", *[name for name in keywords if name != "output_final_state"])
    label = f"B={b} T={t} H={h} K=V={d} bf16" + (f", {gate}" if op == "simple_gla" else "") + ", h0/ht"
    spec = dict(op=op, batch=batch, seq_len=seq_len, heads=heads, gate=gate)
    return Problem(op, label, arrays, keywords, differentiable, spec)


def production_problems() -> list[Problem]:
    """The shapes of the issues: B=2 T=4096 H=16 K=V=128 bf16 (KDA also B=1 T=8192 H=32)."""
    return [
        attention_problem("simple_gla", 2, 4096, 16, gate="g"),
        attention_problem("simple_gla", 2, 4096, 16, gate="g_gamma"),
        attention_problem("gla", 2, 4096, 16),
        attention_problem("kda", 2, 4096, 16),
        attention_problem("kda", 1, 8192, 32),
    ]


def _nbytes(struct: jax.ShapeDtypeStruct) -> int:
    return math.prod(struct.shape) * jnp.dtype(struct.dtype).itemsize


def hbm_floor_bytes(problem: Problem, training: bool) -> int:
    """Bytes any implementation must move: inputs read, outputs written (and do, gradients)."""
    inputs = [*problem.arrays, *(v for v in problem.keywords.values() if isinstance(v, jax.ShapeDtypeStruct))]
    o = problem.arrays[2]
    state = problem.keywords.get("initial_state")
    outputs = [o] + ([state] if state is not None else [])
    total = sum(map(_nbytes, inputs)) + sum(map(_nbytes, outputs))
    if training:
        total += _nbytes(o) + sum(map(_nbytes, inputs))  # read do, write one gradient per input
    return total


def _named(problem: Problem, values: Sequence) -> tuple[tuple, dict]:
    positional = ("q", "k", "v")
    named = dict(zip(problem.differentiable, values, strict=True))
    arrays = tuple(named.pop(name) for name in positional)
    return arrays, {**problem.keywords, **named}


def forward_fn(problem: Problem, impl: str | None, impl_options: dict | None = None):
    """fn(*differentiable arrays) -> (o, final state), for compiling the forward alone."""

    def forward(*values):
        arrays, keywords = _named(problem, values)
        return dispatch(problem.op, *arrays, impl=impl, impl_options=impl_options or {}, **keywords)

    return forward


def training_step_fn(problem: Problem, impl: str | None, impl_options: dict | None = None):
    """fn(*differentiable arrays, do, dht) -> (o, final state) and the gradients of
    sum(o * do) + sum(final state * dht) for every differentiable input."""

    def step(*args):
        values, do, dht = args[:-2], args[-2], args[-1]

        def run(*values):
            arrays, keywords = _named(problem, values)
            return dispatch(problem.op, *arrays, impl=impl, impl_options=impl_options or {}, **keywords)

        outputs, vjp = jax.vjp(run, *values)
        return outputs, vjp((do, dht))

    return step


def training_structs(problem: Problem) -> list[jax.ShapeDtypeStruct]:
    """Arguments of `training_step_fn(problem, impl)`: every differentiable input, then the
    cotangents `do` and `dht`."""
    final_state = problem.keywords["initial_state"]
    return [*(_struct_of(problem, n) for n in problem.differentiable), problem.arrays[2], final_state]


def tpu_implementations(problem: Problem) -> list[tuple[str, str | None]]:
    """(name, decline reason or None) of the Pallas implementations and `xla`, for this problem.

    `reference` and `recurrent` (token-by-token scans kept for checking) are left out.
    """
    with use(backend="tpu", interpret=False):
        resolution = explain(problem.op, *problem.arrays, **problem.keywords)
    return [
        (c.implementation.name, c.reason)
        for c in resolution.candidates
        if c.implementation.interpretable or c.implementation.name == "xla"
    ]


@dataclasses.dataclass(frozen=True)
class CostRow:
    problem: Problem
    implementation: str
    chip: str
    forward: CompileReport | None
    training: CompileReport | None
    note: str | None = None
    cycles: tuple = ()  # (stage, CycleFit) for each Pallas kernel (v6e only, when asked)


def _with_cycles(row: CostRow) -> CostRow:
    """Adds static cycle fits of every Pallas kernel of the row (v6e profiles cover Pallas)."""
    fits = []
    for stage, report in (("fwd", row.forward), ("train", row.training)):
        names = sorted({k.name for k in report.kernels})
        if names:
            spec = dict(row.problem.spec, impl=row.implementation, stage=stage)
            fits.extend((stage, fit) for fit in kernel_cycles(spec, names))
    return dataclasses.replace(row, cycles=tuple(fits))


def measure(
    problems: Sequence[Problem],
    chips: Sequence[str] = CHIPS,
    progress=lambda items, n, label: items,
    cycles: bool = False,
):
    """Compiles every (problem, implementation, chip); failures become rows with a note.

    With `cycles`, also fits the static cycle estimates of every Pallas kernel on v6e.
    """
    jobs = [(p, name, reason, chip) for p in problems for name, reason in tpu_implementations(p) for chip in chips]
    rows = []
    for problem, name, reason, chip in progress(jobs, len(jobs), lambda j: f"{j[0].op} {j[1]} {j[3]}"):
        if reason is not None:
            rows.append(CostRow(problem, name, chip, None, None, f"declined: {reason}"))
            continue
        structs = training_structs(problem)
        try:
            forward = compile_for_tpu(forward_fn(problem, name), structs[:-2], chip=chip)
            training = compile_for_tpu(training_step_fn(problem, name), structs, chip=chip)
            row = CostRow(problem, name, chip, forward, training)
            rows.append(_with_cycles(row) if cycles and chip == "v6e" else row)
        except Exception as error:  # a compile failure is a finding to report, not a crash
            rows.append(CostRow(problem, name, chip, None, None, f"compile failed: {type(error).__name__}: {error}"))
    return rows


def _struct_of(problem: Problem, name: str) -> jax.ShapeDtypeStruct:
    positional = dict(zip(("q", "k", "v"), problem.arrays, strict=True))
    return positional.get(name) or problem.keywords[name]


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _giga(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def render_markdown(rows: Sequence[CostRow], decode_rows: Sequence = ()) -> str:
    """The report: per problem, the HBM floor, then per implementation and chip the compiler's numbers;
    then the serving decode steps (`gla_core.cost_decode.DecodeRow`s)."""
    from gla_core.cost_decode import render_decode

    lines = [
        "# TPU cost report (compiler estimates, not measurements)",
        "",
        "Every number below comes from compiling for libtpu compile-only devices on a host without a",
        "TPU: `pl.CostEstimate` values are what our launchers declare to XLA, scoped VMEM is what Mosaic",
        "reserved, temp memory is XLA's `memory_analysis()`. None of it was measured on hardware.",
        "The HBM floor is the bytes any implementation must move divided by the HBM bandwidth.",
        "",
        f"Regenerate: {REGENERATE}. A partial run (`gla cost --op OP ...`) replaces only its rows.",
        "",
    ]
    problems = []
    for row in rows:
        if row.problem not in problems:
            problems.append(row.problem)
    for problem in problems:
        lines += [f"## {problem.op}: {problem.label}", ""]
        floors = [
            f"{chip} fwd {hbm_floor_bytes(problem, False) / HBM_BANDWIDTH[chip] * 1e6:.0f} us, "
            f"train step {hbm_floor_bytes(problem, True) / HBM_BANDWIDTH[chip] * 1e6:.0f} us"
            for chip in CHIPS
        ]
        lines += [
            f"HBM floor: {_mib(hbm_floor_bytes(problem, False))} MiB forward, "
            f"{_mib(hbm_floor_bytes(problem, True))} MiB training step; " + "; ".join(floors) + ".",
            "",
            "| impl | chip | train-step temp MiB | fwd temp MiB | kernel (program) | scoped VMEM KiB "
            "| GFLOP | transcendentals (M) | GB accessed |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in (r for r in rows if r.problem == problem):
            if row.note:
                lines.append(f"| {row.implementation} | {row.chip} | {row.note} | | | | | | |")
                continue
            temps = f"{_mib(row.training.temp_bytes)} | {_mib(row.forward.temp_bytes)}"
            head = f"| {row.implementation} | {row.chip} | {temps}"
            kernels = [("fwd", k) for k in row.forward.kernels] + [("train", k) for k in row.training.kernels]
            if not kernels:
                lines.append(f"{head} | (no Pallas kernel: plain XLA) | | | | |")
            for index, (stage, k) in enumerate(kernels):
                prefix = head if index == 0 else "| | | |"
                transcendentals = "-" if k.transcendentals is None else f"{k.transcendentals / 1e6:.1f}"
                lines.append(
                    f"{prefix} | {stage}: {k.name} | {k.scoped_vmem_bytes / 1024:.0f} | {_giga(k.flops)} | "
                    f"{transcendentals} | {_giga(k.bytes_accessed)} |"
                )
        fitted = [r for r in rows if r.problem == problem and r.cycles]
        if fitted:
            spec = problem.spec
            programs = spec["batch"] * spec["heads"]
            fit_lens = ", ".join(str(t) for t, _ in fitted[0].cycles[0][1].points)
            lines += [
                "",
                f"Static cycle estimates (v6e LLO profile): each kernel compiled with B = H = 1 at T = {fit_lens}, "
                f"fitted as a + b*T, and extrapolated linearly in grid steps to B*H*T = "
                f"{spec['batch']}*{spec['heads']}*{spec['seq_len']} as a + b*B*H*T "
                "(a is a fit intercept and can come out slightly negative):",
                "",
                "| impl | stage: kernel | a (cycles) | b (cycles per token and head) | cycles at B*H*T "
                "| fit points (T: cycles) |",
                "|---|---|---|---|---|---|",
            ]
            for row in fitted:
                for stage, fit in row.cycles:
                    points = ", ".join(f"{t}: {c}" for t, c in fit.points)
                    lines.append(
                        f"| {row.implementation} | {stage}: {fit.kernel} | {fit.intercept:.0f} | {fit.slope:.1f} | "
                        f"{fit.at(spec['seq_len'], programs) / 1e6:.2f} M | {points} |"
                    )
        lines.append("")
    lines += render_decode(decode_rows)
    return "\n".join(lines)


def build_program(spec: dict):
    """`(fn, argument structs)` of the program a `gla_core.static_profile` spec describes.

    `{"program": "matmul", "size": N}`: an N^3 bfloat16 matmul (the clock calibration);
    `{"program": "attention", "op", "batch", "seq_len", "heads", "gate", "impl", "stage"}`: the
    forward (`stage` "fwd") or the training step ("train") of `attention_problem(...)` with `impl`
    (None: the default implementation on TPU) and `impl_options` if given;
    `{"program": "decode", "op"}`: the serving decode step of `gla_core.decode.serving.serving_problem(op)`
    (its pool is argument `spec["donate_argnums"]`, see `gla_core.cost_decode`).
    """
    if spec["program"] == "decode":
        from gla_core.decode.serving import serving_problem

        problem = serving_problem(spec["op"])
        return problem.fn, list(problem.structs)
    if spec["program"] == "matmul":
        n = spec["size"]
        matrix = _struct(n, n)
        return (lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)), [matrix, matrix]
    problem = attention_problem(spec["op"], spec["batch"], spec["seq_len"], spec["heads"], gate=spec["gate"])
    options = spec.get("impl_options") or {}
    structs = training_structs(problem)
    if spec["stage"] == "fwd":
        return forward_fn(problem, spec["impl"], options), structs[:-2]
    return training_step_fn(problem, spec["impl"], options), structs


def compile_stage(spec: dict) -> None:
    """Compiles one forward (`spec["stage"] == "fwd"`) or training step for a compile-only v6e
    device; `gla_core.cycles` runs it in a subprocess with libtpu's static profile enabled."""
    problem = attention_problem(spec["op"], spec["batch"], spec["seq_len"], spec["heads"], gate=spec["gate"])
    structs = training_structs(problem)
    if spec["stage"] == "fwd":
        compile_for_tpu(forward_fn(problem, spec["impl"]), structs[:-2], chip="v6e")
    else:
        compile_for_tpu(training_step_fn(problem, spec["impl"]), structs, chip="v6e")


if __name__ == "__main__":
    compile_stage(json.loads(sys.argv[1]))
