"""Measuring the programs of the TPU cost report with libtpu's static cost model, within a memory budget.

For every problem (`gla_core.cost.production_problems`) and chip, the forward and the training step
of the default implementation on TPU (and of the peers that stand beside the op,
`gla_core.cost_peers`) are measured by three compile jobs in subprocesses (`gla_core.static_profile`):

1. the programs at the full shape, around empty kernels: XLA's memory analysis (the HBM floor is
   the argument + output bytes), temp memory, the bytes the top-level XLA ops write, the Pallas
   calls, and the probe length of each program (`gla_core.cost_scaling`);
2. every Pallas call alone on the two probe problems, profiled: cycles, scoped VMEM, compile time
   and memory;
3. every kernel whose full-shape compile is predicted (`predict_compile`, from its larger probe) to
   fit in the full-shape budget, compiled alone at the full shape: its cycles are then exact, and
   the difference to the probes' scaling is the measured error of the method. The other kernels'
   cycles are the scaled ones, and the report says why (their predicted memory). A kernel of a
   program without probe length is compiled at the full shape whatever its size; a kernel whose
   probe failed (libtpu aborts on some) is not compiled again and fails with the probe's error.

Every job reserves memory (`MemoryGate`): at most `jobs` run at once (default 2, one per core), their
reservations within the memory budget, and a job whose process outgrows its reservation is killed;
what it was compiling is compiled again reserving more (the memory budget, or for a full-shape
compile the full-shape budget). Compiler estimates, not measurements.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from gla_core.cost import STAGES, Problem, chosen_implementation, program_spec
from gla_core.cost_peers import peer_spec, peers_of
from gla_core.cost_scaling import predict_compile, probe_candidates, probe_spec, scale_cycles, tokens
from gla_core.errors import InvalidArgumentError
from gla_core.static_profile import (
    GIB,
    HBM_BANDWIDTH,
    KernelCall,
    KernelProfile,
    ProfileError,
    StubbedProgram,
    calibrate_clock,
    profile_kernels,
    stub_programs,
)

DEFAULT_MEMORY_BUDGET = 12 * GIB
DEFAULT_JOBS = 2
# Reservations of the jobs whose memory nothing predicts (measured: a stub compile 0.6 GB, a calibration
# 2.2 GB on v5e, the probes of gla's training step at B=1 T=512 and 1024, H=16: 1.2 GB). A stub or probe
# job killed for outgrowing its reservation runs again reserving the whole memory budget.
STUB_RESERVE = 2 * GIB
PROBE_RESERVE = 3 * GIB
CALIBRATION_RESERVE = 4 * GIB


@dataclasses.dataclass(frozen=True)
class KernelEstimate:
    """One Pallas call of a program at the full shape.

    Attributes:
      name: the call's name; steps: its grid steps at the full shape.
      cycles: its static cycles at the full shape (compiled there if `method` is "full", else scaled).
      vmem_bytes: the scoped VMEM Mosaic reserved (probes and full shape have the same blocks).
      method: "full" (compiled at the full shape), "scaled" (from the probes) or "failed".
      probes: (tokens, cycles) of the two probe compiles (empty when the kernel was not probed).
      scaled: the probes' scaling to the full shape (also for "full": the method's measured error).
      compile_bytes, compile_seconds: peak memory and CPU time of the full-shape compile ("full" only).
      predicted_bytes, predicted_seconds: the same predicted from the larger probe (0 without probes).
      note: why a "scaled" kernel was not compiled at the full shape, or why a "failed" one has no cycles.
    """

    name: str
    steps: int
    cycles: int
    vmem_bytes: int
    method: str
    probes: tuple[tuple[int, int], ...] = ()
    scaled: int = 0
    compile_bytes: int = 0
    compile_seconds: float = 0.0
    predicted_bytes: int = 0
    predicted_seconds: float = 0.0
    note: str = ""


@dataclasses.dataclass(frozen=True)
class ProgramRow:
    """One program (a stage of a problem, one implementation, one chip) of the report.

    Attributes:
      problem: the problem's `attention_problem` arguments; label: its shape in words.
      stage: "fwd" or "train"; chip: "v6e" or "v5e".
      implementation: our implementation's name, or the peer's; peer: whether it is a peer's.
      clock_hz: the static model's calibrated clock on the chip.
      argument_bytes, output_bytes, temp_bytes: XLA's memory analysis at the full shape.
      xla_bytes: bytes written by the top-level XLA ops around the kernels at the full shape.
      kernels: every Pallas call, in program order.
      note: why the program has no numbers (it did not compile), else "".
    """

    problem: dict
    label: str
    stage: str
    chip: str
    implementation: str
    peer: bool
    clock_hz: float
    argument_bytes: int = 0
    output_bytes: int = 0
    temp_bytes: int = 0
    xla_bytes: int = 0
    kernels: tuple[KernelEstimate, ...] = ()
    note: str = ""

    @property
    def op(self) -> str:
        return self.problem["op"]

    @property
    def floor_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes

    @property
    def floor_seconds(self) -> float:
        return self.floor_bytes / HBM_BANDWIDTH[self.chip]

    @property
    def pallas_cycles(self) -> int:
        return sum(k.cycles for k in self.kernels)

    @property
    def seconds(self) -> float:
        """Pallas static time: the kernels' cycles over the calibrated clock."""
        return self.pallas_cycles / self.clock_hz

    @property
    def ratio(self) -> float:
        return self.seconds / self.floor_seconds

    @property
    def complete(self) -> bool:
        """Whether every kernel has cycles (none failed) and the program compiled."""
        return not self.note and all(k.method != "failed" for k in self.kernels)


class MemoryGate:
    """Admits compile jobs by the memory they reserve: at most `jobs` at once, their reservations
    summing to at most `budget` bytes. The largest waiting reservation goes first (ties: the
    earliest) and a smaller one does not overtake it, so a large job is not starved by small ones."""

    def __init__(self, jobs: int, budget: int):
        self.jobs, self.budget = jobs, budget
        self.running: list[int] = []
        self.waiting: list[tuple[int, int]] = []  # (reservation, -arrival)
        self.arrivals = itertools.count()
        self.condition = threading.Condition()

    def _admits(self, entry: tuple[int, int]) -> bool:
        fits = len(self.running) < self.jobs and sum(self.running) + entry[0] <= self.budget
        return fits and max(self.waiting) == entry

    def run(self, reservation: int, work: Callable[[int], object]):
        """`work(limit)` once admitted, where limit = the reservation (at most the budget): the memory
        its job may take before it is killed."""
        entry = (min(reservation, self.budget), -next(self.arrivals))
        with self.condition:
            self.waiting.append(entry)
            self.condition.wait_for(lambda: self._admits(entry))
            self.waiting.remove(entry)
            self.running.append(entry[0])
        try:
            return work(entry[0])
        finally:
            with self.condition:
                self.running.remove(entry[0])
                self.condition.notify_all()


@dataclasses.dataclass(frozen=True)
class Program:
    """One program to measure: its spec at the full shape and how the report names it."""

    spec: dict
    stage: str
    implementation: str
    peer: bool


def programs_of(
    problem: Problem, with_peers: bool = True, extra: Sequence[str] = (), ours: bool = True
) -> list[Program]:
    """The forward and training step of the problem's default implementation on TPU and of the
    implementations named in `extra` (`ours`), and (`with_peers`) of its op's installed peers."""
    programs = []
    for impl in (None, *extra) if ours else ():
        name = impl or chosen_implementation(problem)
        programs += [Program(program_spec(problem, stage, impl), stage, name, False) for stage in STAGES]
    for peer in peers_of(problem.op) if with_peers else ():
        if peer.installed():
            programs += [Program(peer_spec(peer.name, problem.spec, s), s, peer.name, True) for s in STAGES]
    return programs


@dataclasses.dataclass(frozen=True)
class _Probed:
    """What a kernel's two probe compiles say about it at the full shape: the probes' (tokens, cycles),
    the cycles scaled from them, the scoped VMEM, and its full-shape compile's predicted peak and time."""

    points: tuple[tuple[int, int], tuple[int, int]]
    scaled: int
    vmem_bytes: int
    compile_bytes: int
    compile_seconds: float


class _Pipeline:
    """The measurement of one problem on one chip (stub, probes, full-shape compiles), its jobs
    passed through the shared `MemoryGate`."""

    def __init__(self, problem: Problem, programs: list[Program], chip: str, gate: MemoryGate, full_budget: int):
        self.problem, self.programs, self.chip, self.gate = problem, programs, chip, gate
        self.full_budget = full_budget
        self.specs = [program.spec for program in programs]

    def run(self, clock_hz: float) -> list[ProgramRow]:
        try:
            stubbed, lengths = self._stub()
        except ProfileError as error:
            return [self._row(p, clock_hz, note=f"compile failed: {error}") for p in self.programs]
        try:
            probed = self._probes(stubbed, lengths)
            full = self._full_shape(stubbed, probed)
        except ProfileError as error:
            note = f"profile failed: {error}"
            return [self._row(p, clock_hz, stubbed[i], note=note) for i, p in enumerate(self.programs)]
        rows = []
        for i, program in enumerate(self.programs):
            estimates = [
                self._estimate(call, probed.get((i, k)), full.get((i, k))) for k, call in enumerate(stubbed[i].calls)
            ]
            rows.append(self._row(program, clock_hz, stubbed[i], estimates))
        return rows

    def _stub(self) -> tuple[list[StubbedProgram], dict[int, int | None]]:
        """The stubbed programs and each program's probe length (None: it cannot be probed)."""
        ladders = [probe_candidates(spec) for spec in self.specs]
        probes = [[probe_spec(spec, t) for t in ladder] for spec, ladder in zip(self.specs, ladders, strict=True)]
        stub = lambda limit: stub_programs(self.specs, self.chip, probes, limit)
        try:
            stubbed = self.gate.run(STUB_RESERVE, stub)
        except ProfileError as error:
            if not error.over_memory:
                raise
            stubbed = self.gate.run(self.gate.budget, stub)
        lengths = {i: None if s.probe is None else ladders[i][s.probe] for i, s in enumerate(stubbed)}
        return stubbed, lengths

    def _kernels(
        self, specs: list[dict], reservation: int, ceiling: int, only: list[tuple[int, int]] | None = None
    ) -> dict[tuple[int, int], KernelProfile]:
        """The profiles of every kernel of `specs` (or `only` the (spec, kernel) pairs given) by (spec,
        kernel), compiled in one job reserving `reservation`; kernels killed for outgrowing it are
        compiled again in a job reserving `ceiling`."""

        def run(pairs, reserve: int) -> dict[tuple[int, int], KernelProfile]:
            profiles = self.gate.run(reserve, lambda limit: profile_kernels(specs, self.chip, pairs, limit))
            return {(p, k.index): k for p, kernels in enumerate(profiles) for k in kernels}

        found = run(only, reservation)
        killed = [pair for pair, kernel in found.items() if kernel.over_memory]
        if killed and min(reservation, self.gate.budget) < ceiling:
            found.update(run(killed, ceiling))
        return found

    def _probes(
        self, stubbed: list[StubbedProgram], lengths: dict[int, int | None]
    ) -> dict[tuple[int, int], _Probed | str]:
        """Every kernel of every program that has a probe length, by (program, kernel): its two probes
        (one job for all programs), or why one failed to compile."""
        probed = [i for i, t in lengths.items() if t is not None]
        specs = [probe_spec(self.specs[i], t) for i in probed for t in (lengths[i], 2 * lengths[i])]
        if not specs:
            return {}
        profiles = self._kernels(specs, PROBE_RESERVE, self.gate.budget)
        found: dict[tuple[int, int], _Probed | str] = {}
        for n, i in enumerate(probed):
            for k in range(len(stubbed[i].calls)):
                first, second = profiles[(2 * n, k)], profiles[(2 * n + 1, k)]
                if first.error or second.error:
                    found[(i, k)] = f"its probe compile failed ({first.error or second.error})"
                    continue
                points = ((lengths[i], first.cycles), (2 * lengths[i], second.cycles))
                scaled = scale_cycles(points, tokens(self.specs[i]))
                found[(i, k)] = _Probed(points, scaled, second.vmem_bytes, *predict_compile(second, scaled))
        return found

    def _full_shape(
        self, stubbed: list[StubbedProgram], probed: dict[tuple[int, int], _Probed | str]
    ) -> dict[tuple[int, int], KernelProfile]:
        """Compiles at the full shape, in one job, every kernel predicted to fit the full-shape budget
        and every kernel without probes (reserving the whole memory budget for it); a kernel killed for
        outgrowing the job's reservation is compiled again reserving the full-shape budget. A kernel
        whose probe failed is not tried again."""
        wanted = {}
        for i, program in enumerate(stubbed):
            for k in range(len(program.calls)):
                scaled = probed.get((i, k))
                if scaled is None:
                    wanted[(i, k)] = self.gate.budget
                elif isinstance(scaled, _Probed) and scaled.compile_bytes <= self.full_budget:
                    wanted[(i, k)] = scaled.compile_bytes
        if not wanted:
            return {}
        return self._kernels(self.specs, max(wanted.values()), self.full_budget, sorted(wanted))

    def _estimate(self, call: KernelCall, probed: _Probed | str | None, compiled: KernelProfile | None):
        """The kernel's numbers: compiled at the full shape if that worked, else scaled, else failed."""
        kernel = functools.partial(KernelEstimate, call.name, call.steps)
        probes = {}
        if isinstance(probed, _Probed):
            predicted = dict(predicted_bytes=probed.compile_bytes, predicted_seconds=probed.compile_seconds)
            probes = dict(probes=probed.points, scaled=probed.scaled, **predicted)
        if compiled is not None and not compiled.error:
            measured = dict(compile_bytes=compiled.peak_bytes, compile_seconds=compiled.seconds)
            return kernel(compiled.cycles, compiled.vmem_bytes, "full", **probes, **measured)
        if not isinstance(probed, _Probed):
            return kernel(0, 0, "failed", note=probed or (compiled.error if compiled else "not profiled"))
        if compiled is not None:
            note = f"its full-shape compile failed ({compiled.error})"
        else:
            predicted, budget = probed.compile_bytes / GIB, self.full_budget / GIB
            note = f"its full-shape compile is predicted to take {predicted:.1f} GiB, over the {budget:g} GiB budget"
        return kernel(probed.scaled, probed.vmem_bytes, "scaled", **probes, note=note)

    def _row(self, program: Program, clock_hz: float, stubbed: StubbedProgram | None = None, kernels=(), note=""):
        memory = {}
        if stubbed is not None:
            profile = stubbed.profile
            memory = dict(
                argument_bytes=profile.argument_bytes,
                output_bytes=profile.output_bytes,
                temp_bytes=profile.temp_bytes,
                xla_bytes=profile.xla_bytes,
            )
        return ProgramRow(
            self.problem.spec,
            self.problem.label,
            program.stage,
            self.chip,
            program.implementation,
            program.peer,
            clock_hz,
            kernels=tuple(kernels),
            note=note,
            **memory,
        )


def calibrate(chips: Sequence[str], gate: MemoryGate) -> dict[str, float]:
    """The static model's clock on every chip (the calibration matmul, one job per chip)."""

    def clock(chip: str) -> float:
        return gate.run(CALIBRATION_RESERVE, lambda limit: calibrate_clock(chip, limit))

    with ThreadPoolExecutor(len(chips)) as pool:
        return dict(zip(chips, pool.map(clock, chips), strict=True))


def measure(
    problems: Sequence[Problem],
    chips: Sequence[str],
    *,
    peered: Sequence[str] = (),
    extra: dict[str, Sequence[str]] | None = None,
    ours: bool = True,
    jobs: int = DEFAULT_JOBS,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    full_shape_budget: int | None = None,
    progress: Callable[[str], None] = lambda message: None,
    measured: Callable[[dict[str, float], list[ProgramRow]], None] = lambda clocks, rows: None,
) -> tuple[dict[str, float], list[ProgramRow]]:
    """(clock per chip, a row per program) of every problem on every chip; `measured(clocks, rows)` is
    called with the rows of every problem and chip as they come (from several threads).

    `peered`: the labels of the problems to measure the peers on; `extra`: implementations to measure
    besides the default, by the problem's label; `ours`: measure our implementations (else the peers
    only, on the problems of `peered`). `memory_budget`: the memory the compile jobs may
    reserve at once; `full_shape_budget` (default and at most: `memory_budget`): kernels whose
    full-shape compile is predicted to fit it are compiled at the full shape (0: none, every kernel
    that can be is scaled from its probes).
    """
    full = memory_budget if full_shape_budget is None else full_shape_budget
    if not 0 <= full <= memory_budget:
        raise InvalidArgumentError(
            f"full_shape_budget: expected 0 to the memory budget ({memory_budget / GIB:g} GiB), got {full / GIB:g} GiB"
        )
    gate = MemoryGate(jobs, memory_budget)
    clocks = calibrate(chips, gate)
    pipelines = [
        _Pipeline(p, programs_of(p, p.label in peered, (extra or {}).get(p.label, ()), ours), chip, gate, full)
        for p in problems
        if ours or p.label in peered
        for chip in chips
    ]

    def run(pipeline: _Pipeline) -> list[ProgramRow]:
        rows = pipeline.run(clocks[pipeline.chip])
        progress(f"{pipeline.problem.op} {pipeline.problem.label} {pipeline.chip}: {len(rows)} programs")
        measured(clocks, rows)
        return rows

    with ThreadPoolExecutor(max(1, len(pipelines))) as pool:
        measured = list(pool.map(run, pipelines))
    return clocks, [row for rows in measured for row in rows]
