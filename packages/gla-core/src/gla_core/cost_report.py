"""The markdown of the TPU cost report (`docs/perf/tpu-cost.md`) from measured `ProgramRow`s: every
program against its HBM floor with the project's targets, every kernel with how its cycles were
obtained, the scaling's measured error, the peers and the serving decode steps."""

from __future__ import annotations

from collections.abc import Sequence

from gla_core.cost_decode import DecodeRow, render_decode
from gla_core.cost_measure import DEFAULT_MEMORY_BUDGET, KernelEstimate, ProgramRow
from gla_core.cost_peers import NOT_PEERS, PEERS
from gla_core.cost_scaling import MEMORY_MARGIN, scale_cycles
from gla_core.static_profile import CALIBRATION_SIZE, GIB, HBM_BANDWIDTH, PEAK_BF16_FLOPS

REGENERATE = "`nox -s cost` (runs `gla cost --output docs/perf/tpu-cost.md`)"
# Targets: Pallas static time over the HBM floor, per op and stage.
RATIO_TARGETS = {("simple_gla", "fwd"): 2.5, ("simple_gla", "train"): 3.0, ("gla", "fwd"): 2.5}
RATIO_TARGETS.update({("gla", "train"): 3.0, ("kda", "fwd"): 4.0, ("kda", "train"): 5.0})
XLA_BYTES_TARGET = 0.1  # XLA-side bytes over the floor bytes
TEMP_TARGETS = {("fused_g_gamma", "train"): 100 * 2**20}  # bytes
PROGRAM_COLUMNS = ("op", "problem", "impl", "stage", "chip")
SUMMARY_COLUMNS = (
    "Pallas static time",
    "HBM floor",
    "ratio",
    "XLA-side MiB (share of floor)",
    "temp MiB",
    "kernels",
    "targets",
)
MIB = 2**20


def _mark(ok: bool) -> str:
    return "ok" if ok else "**missed**"


def _same_program(a: ProgramRow, b: ProgramRow) -> bool:
    return (a.op, a.label, a.stage, a.chip) == (b.op, b.label, b.stage, b.chip)


def target_notes(row: ProgramRow, rows: Sequence[ProgramRow] = ()) -> list[str]:
    """How the row stands against each target that applies to it: its ratio, XLA-side bytes and temp
    memory, and its static time against every complete peer row of the same program among `rows`
    (no targets for a peer's row or an incomplete one)."""
    if row.peer or not row.complete:
        return []
    notes = []
    ratio = RATIO_TARGETS.get((row.op, row.stage))
    if ratio is not None:
        notes.append(f"ratio <= {ratio:g}: {_mark(row.ratio <= ratio)}")
    xla_ok = row.xla_bytes <= XLA_BYTES_TARGET * row.floor_bytes
    notes.append(f"XLA bytes <= {XLA_BYTES_TARGET:g} floor: {_mark(xla_ok)}")
    temp = TEMP_TARGETS.get((row.implementation, row.stage))
    if temp is not None:
        notes.append(f"temp <= {temp / MIB:g} MiB: {_mark(row.temp_bytes <= temp)}")
    for peer in (p for p in rows if p.peer and p.complete and _same_program(p, row)):
        notes.append(f"faster than {peer.implementation}: {_mark(row.seconds < peer.seconds)}")
    return notes


def _header(*columns: str) -> list[str]:
    """A markdown table's header: the program's columns, then `columns`."""
    names = (*PROGRAM_COLUMNS, *columns)
    return ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]


def _program(row: ProgramRow) -> str:
    """The program's cells of a table line (open at the end)."""
    return f"| {row.op} | {row.label} | {row.implementation} | {row.stage} | {row.chip}"


def _methods(row: ProgramRow) -> str:
    """How many kernels were compiled at the full shape, scaled, failed."""
    counts = {method: sum(k.method == method for k in row.kernels) for method in ("full", "scaled", "failed")}
    return ", ".join(f"{n} {method}" for method, n in counts.items() if n)


def summary_lines(rows: Sequence[ProgramRow]) -> list[str]:
    """One line per program: static time, floor, ratio, XLA-side bytes, temp, kernels, targets."""
    lines = _header(*SUMMARY_COLUMNS)
    for row in rows:
        head = _program(row)
        if row.note:
            lines.append(f"{head} | {row.note[:300]} | | | | | | |")
            continue
        failed = [k.name for k in row.kernels if k.method == "failed"]
        time = f"{row.seconds * 1e6:,.0f} us" if not failed else f"incomplete ({', '.join(failed)} failed)"
        ratio = f"{row.ratio:.2f}" if not failed else "-"
        xla = f"{row.xla_bytes / MIB:,.1f} ({row.xla_bytes / row.floor_bytes:.2f})"
        lines.append(
            f"{head} | {time} | {row.floor_seconds * 1e6:,.0f} us | {ratio} | {xla} | {row.temp_bytes / MIB:,.1f} "
            f"| {_methods(row)} | {'; '.join(target_notes(row, rows))} |"
        )
    return lines


def _compile_cell(kernel: KernelEstimate) -> str:
    """The full-shape compile's peak memory and CPU time: measured, or predicted (~) for a scaled kernel."""
    if kernel.method == "full":
        return f"{kernel.compile_bytes / GIB:.1f} GiB, {kernel.compile_seconds:.0f} s"
    if kernel.predicted_bytes:
        return f"~{kernel.predicted_bytes / GIB:.1f} GiB, ~{kernel.predicted_seconds:.0f} s"
    return ""


def kernel_lines(rows: Sequence[ProgramRow]) -> list[str]:
    """One line per kernel of every program: cycles, how they were obtained, grid steps, scoped VMEM."""
    columns = ("kernel", "grid steps", "static cycles", "method", "probes (B*T: cycles)", "full-shape compile")
    lines = _header(*columns, "scoped VMEM KiB", "note")
    for row in rows:
        for kernel in row.kernels:
            probes = ", ".join(f"{t}: {c:,}" for t, c in kernel.probes)
            lines.append(
                f"{_program(row)} | {kernel.name} | {kernel.steps:,} | {kernel.cycles:,} | {kernel.method} | {probes} "
                f"| {_compile_cell(kernel)} | {kernel.vmem_bytes / 1024:,.0f} | {kernel.note[:300]} |"
            )
    return lines


def scaling_errors(rows: Sequence[ProgramRow]) -> list[tuple[ProgramRow, KernelEstimate, float]]:
    """(row, kernel, relative error of the probes' scaling) of every kernel compiled at the full shape
    that was also scaled from its probes."""
    return [
        (row, kernel, kernel.scaled / kernel.cycles - 1)
        for row in rows
        for kernel in row.kernels
        if kernel.method == "full" and kernel.scaled and kernel.cycles
    ]


# One validation at a shape that did not fit then: the gla training step at B=2 T=4096 H=16 K=V=128
# on v6e with the kernels of commit 641db61, every kernel compiled at the full shape (7.7 min, ~21 GB)
# and on the probes B=1 T=512 and T=1024: kernel, full-shape cycles, probe cycles.
GLA_TRAINING_VALIDATION = (
    ("chunk_fwd", 1_938_102, (122_882, 244_324)),
    ("chunk_fwd_h", 666_310, (43_774, 85_494)),
    ("chunk_bwd_dh", 689_013, (45_209, 88_355)),
    ("chunk_bwd_dv", 337_886, (22_728, 43_783)),
    ("chunk_bwd_dqkg", 2_028_593, (129_134, 255_790)),
)


def _fixed_validation_lines() -> list[str]:
    lines = [
        "Once, at a production shape: the gla training step at B=2 T=4096 H=16 K=V=128 on v6e with the kernels of "
        "commit 641db61 (before the current ones), every kernel compiled at the full shape (7.7 min, ~21 GB peak) "
        "and scaled from probes at B=1 T=512 and 1024 (B*T 8192: 16x the first probe):",
        "",
        "| kernel | compiled at full shape | scaled from probes | error |",
        "|---|---|---|---|",
    ]
    total_full = total_scaled = 0
    for name, full, (first, second) in GLA_TRAINING_VALIDATION:
        scaled = scale_cycles([(512, first), (1024, second)], 2 * 4096)
        total_full, total_scaled = total_full + full, total_scaled + scaled
        lines.append(f"| {name} | {full:,} | {scaled:,} | {scaled / full - 1:+.2%} |")
    lines.append(f"| (training step) | {total_full:,} | {total_scaled:,} | {total_scaled / total_full - 1:+.2%} |")
    return lines


def validation_lines(rows: Sequence[ProgramRow]) -> list[str]:
    """The measured error of the method: kernels compiled at the full shape against their scaling, and
    against the prediction of their compile's memory and time, in this run and once at a production shape."""
    errors = scaling_errors(rows)
    if not errors:
        lines = ["In this run no kernel was compiled both at the full shape and on probes."]
    else:
        worst = max(abs(e) for _, _, e in errors)
        memory = [k.predicted_bytes / k.compile_bytes for _, k, _ in errors if k.compile_bytes]
        lines = [
            f"In this run, {len(errors)} kernels were compiled at the full shape and also scaled from their probes: "
            f"the scaling's error is at most {worst:.2%} (scaled / compiled - 1). Their compiles' predicted peak "
            f"memory came out {min(memory):.2f} to {max(memory):.2f} times the measured one (a full-shape compile "
            "outgrowing its job's reservation is killed and run again with the whole budget):",
            "",
            *_header("kernel", "compiled at full shape", "scaled from probes", "error", "compile peak GiB, CPU s"),
        ]
        lines += [
            f"{_program(row)} | {kernel.name} | {kernel.cycles:,} | {kernel.scaled:,} | {error:+.2%} "
            f"| {kernel.compile_bytes / GIB:.2f}, {kernel.compile_seconds:.0f} (predicted "
            f"{kernel.predicted_bytes / GIB:.2f}, {kernel.predicted_seconds:.0f}) |"
            for row, kernel, error in errors
        ]
    return [*lines, "", *_fixed_validation_lines()]


def _clock_lines(clocks: dict[str, float]) -> list[str]:
    lines = []
    for chip, hz in sorted(clocks.items(), reverse=True):
        seconds = 2 * CALIBRATION_SIZE**3 / PEAK_BF16_FLOPS[chip]
        lines.append(
            f"- {chip}: {hz / 1e9:.3f} GHz: a {CALIBRATION_SIZE}^3 bfloat16 matmul estimated at {hz * seconds:,.0f} "
            f"cycles, which take {seconds * 1e6:.0f} us at the chip's peak {PEAK_BF16_FLOPS[chip] / 1e12:.0f} "
            f"TFLOP/s; HBM floor at {HBM_BANDWIDTH[chip] / 1e9:.0f} GB/s."
        )
    return lines


def _scaled_lines(rows: Sequence[ProgramRow], full_shape_budget: int) -> list[str]:
    """Which kernels were scaled rather than compiled at the full shape, and why."""
    scaled = [(row, k) for row in rows for k in row.kernels if k.method == "scaled"]
    budget = f"{full_shape_budget / GIB:g} GiB"
    if not scaled:
        return [f"Every kernel was compiled at the full shape (full-shape budget {budget})."]
    names = sorted({f"{row.op} {row.stage} {k.name}" for row, k in scaled})
    return [
        f"{len(scaled)} kernels were scaled, not compiled at the full shape (full-shape budget {budget}; the kernel "
        f"table's note says why for each): {', '.join(names)}."
    ]


def _peer_lines(rows: Sequence[ProgramRow]) -> list[str]:
    measured = {row.implementation for row in rows if row.peer}
    lines = []
    for peer in PEERS:
        state = "measured below" if peer.name in measured else "not measured in this run (not installed)"
        lines.append(
            f"- {peer.name} (`pip install {peer.requirement}`, `{peer.api}`): beside {peer.op}; {peer.note}; {state}."
        )
    lines += [f"- {name}: {why}." for name, why in NOT_PEERS]
    return lines


def render(
    clocks: dict[str, float],
    rows: Sequence[ProgramRow],
    decode_rows: Sequence[DecodeRow] = (),
    full_shape_budget: int = DEFAULT_MEMORY_BUDGET,
    compiler: str = "",
) -> str:
    """The whole report; `full_shape_budget`: the bytes a kernel's full-shape compile was allowed;
    `compiler`: the versions that compiled it, in words."""
    budget = f"{full_shape_budget / GIB:g} GiB"
    lines = [
        "# TPU cost report (compiler estimates, not measurements)",
        "",
        "**These are libtpu's static estimates from compiling for compile-only TPU devices on a host without a "
        "TPU. Nothing here was measured on a TPU; confirm on hardware when one is available.**",
        "",
        f"Regenerate: {REGENERATE}; `gla cost --help` for partial runs (they replace only their rows).",
        "",
        "## Method",
        "",
        "Each program is the forward `dispatch(...) -> (o, ht)` or the training step (the forward and its VJP with "
        "cotangents `do`, `dht` for every input, in one jitted program) of the default implementation on TPU "
        '(`gla_core.use(backend="tpu")`), or of a peer (below), compiled for a compile-only device of the chip.',
        "",
        "- Pallas static time: the sum of libtpu's `estimated_cycles` (`--xla_jf_dump_static_llo_profile_to`) over "
        "the program's Pallas calls, each compiled alone, over the calibrated clock.",
        "- HBM floor: the compiled program's argument + output bytes (`memory_analysis()`) over the chip's HBM "
        "bandwidth; ratio = static time / floor.",
        "- XLA-side bytes: the bytes written by the top-level XLA ops other than the Pallas calls (transposes, "
        "copies, pads), and temp: XLA's temp memory, both from the program compiled at the full shape with every "
        "Pallas call replaced by an empty kernel.",
        f"- Full shape or scaled: libtpu's estimator runs a kernel's unrolled grid, so a kernel's profile takes "
        f"memory and time in proportion to its cycles. Every kernel is profiled on two probe problems (B=1, the full "
        f"H, K and V, T = t and 2t at the shortest t where every Pallas call has the full shape's blocks). Where its "
        f"full-shape compile is predicted to fit in {budget} (the compile's added memory per cycle on the larger "
        f'probe, x{MEMORY_MARGIN:g}), it is compiled at the full shape too (method "full": exact); elsewhere '
        f'(method "scaled") its cycles are the probes\' line a + b*B*T at the full B*T. The kernel table gives '
        "each full-shape compile's peak memory and time (measured, or ~predicted for a scaled kernel).",
        "",
        *_scaled_lines(rows, full_shape_budget),
        "",
        f"Clock calibration, in the same libtpu as every program here{' (' + compiler + ')' if compiler else ''}:",
        "",
        *_clock_lines(clocks),
        "",
        "## Programs",
        "",
        "Targets (ours only): ratio <= 2.5 forward, <= 3 training step for simple_gla and gla, <= 4 and <= 5 for "
        f"kda; XLA-side bytes <= {XLA_BYTES_TARGET:g} of the floor bytes; fused_g_gamma's training-step temp <= "
        "100 MiB; and faster than every peer measured on the same program.",
        "",
        *summary_lines(rows),
        "",
        "## Kernels",
        "",
        *kernel_lines(rows),
        "",
        "## Validation of the scaling",
        "",
        *validation_lines(rows),
        "",
        "## Peers",
        "",
        *_peer_lines(rows),
        "",
    ]
    return "\n".join(lines + render_decode(decode_rows))
