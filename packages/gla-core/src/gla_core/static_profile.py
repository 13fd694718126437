"""What libtpu's static cost model says about a compiled TPU program, without a TPU.

libtpu writes a static LLO profile, the estimated cycles of every HLO op of a program (Mosaic
kernels included), when `LIBTPU_INIT_ARGS=--xla_jf_dump_static_llo_profile_to=DIR` is set at
start-up. The flag is process-wide and a failing compile can abort the process, so compiles run
in subprocesses (`python -m gla_core.static_profile JOB OUT_DIR`), each a job over one or more
programs (JSON specs understood by `gla_core.cost.build_program`) for one chip:

  - "whole": the program as it is (its static profile: every op's cycles);
  - "stub": the program with its Pallas calls replaced by empty kernels
    (`gla_core.pallas_jaxpr.stub_kernels`): the XLA side, the bytes its top-level ops write
    (transposes, copies, pads: layout work around the kernels; asynchronous copies into on-chip
    memory spaces, XLA's prefetching, are not counted) and XLA's memory analysis, plus a
    description of every Pallas call (name, grid, block shapes) and which of the program's probe
    candidates make the same calls (`first_matching_pair`);
  - "kernels": every Pallas call of the programs compiled alone (the same call on operands of the
    same shapes), profiled: its cycles and the scoped VMEM Mosaic reserved, with the compile's
    CPU time and memory. Calls that lower to the same program are compiled once.
A job's results are written line by line as they come, so when libtpu aborts on one kernel, or the
job is killed for outgrowing its memory reservation (`run_job`), the kernels done are kept, the one
that killed it is reported, and the job resumes after it.

The estimator runs the kernel's instructions as they would execute (its grid unrolled), so a
profile's compile time and memory grow with the kernel's estimated cycles: `gla_core.cost_measure`
profiles large kernels on smaller problems and scales them up. Cycles become seconds with a clock
calibrated in the same libtpu (`calibrate_clock`): the estimate of a 4096^3 bfloat16 matmul over its
time at the chip's peak bfloat16 rate. These are compiler estimates, not measurements.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

from gla_core import llo_schedule
from gla_core.errors import GlaError
from gla_core.pallas_jaxpr import pallas_equations
from gla_core.tpu_checks import is_mosaic_call, scoped_vmem_bytes

# Public spec sheets: peak bfloat16 matmul rate (FLOP/s) and HBM bandwidth (bytes/s) per chip.
PEAK_BF16_FLOPS = {"v5e": 197e12, "v6e": 918e12}
HBM_BANDWIDTH = {"v5e": 819e9, "v6e": 1638e9}
CALIBRATION_SIZE = 4096
PROFILE_FLAG = "--xla_jf_dump_static_llo_profile_to"
# The static profile type-checks every LLO instruction, which the compile alone does not, and aborts on
# packed bfloat16 unpacks it types as int16 ("Expected vector-int16, got vector-bf16packed"): every
# v5e kernel with bfloat16 inputs, and v6e kernels with strided 16-bit loads. The same kernels compile
# without the profile, so the profile runs with the type check off; it leaves every v6e estimate of the
# report unchanged.
NO_TYPE_CHECK_FLAG = "--xla_tpu_check_llo_types=false"
GIB = 2**30
DEFAULT_TIMEOUT = 4 * 3600.0  # seconds a compile job may take (against a hang, not a limit on work)
_WATCH_SECONDS = 0.5  # how often a running job's memory is read
_ESTIMATE = re.compile(r'hlo_op_name:\s*"([^"]+)"\s*estimated_cycles:\s*(\d+)')
# Instructions that write no HBM bytes of their own.
_FREE_OPCODES = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all", "partition-id"}
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
_BYTES.update({"f64": 8, "s64": 8, "u64": 8})
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
# The prefix of a libtpu log line: severity and date, time, thread, source ("F1127 12:26:49.201876 24781 a.cc:66] ").
_LOG_PREFIX = re.compile(r"^[FEWI]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] ")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\(")


def profile_flags(directory: pathlib.Path) -> str:
    """`LIBTPU_INIT_ARGS` that make libtpu write static profiles into `directory`."""
    return f"{PROFILE_FLAG}={directory} {NO_TYPE_CHECK_FLAG}"


class ProfileError(GlaError, RuntimeError):
    """A profiled compile failed (its subprocess exited, aborted or was killed); the message says why,
    `over_memory` whether it was killed for outgrowing its memory reservation."""

    def __init__(self, message: str, over_memory: bool = False):
        super().__init__(message)
        self.over_memory = over_memory


@dataclasses.dataclass(frozen=True)
class XlaOp:
    """A top-level XLA op of the compiled program other than a Pallas kernel."""

    name: str
    opcode: str
    bytes_written: int
    cycles: int


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One Pallas call of a traced program, as its launcher built it.

    Attributes:
      name: the `pallas_call` name.
      grid: the grid; steps: its number of steps.
      blocks: every operand's and result's block shape, as text (equal blocks: equal work per step).
    """

    name: str
    grid: tuple[int, ...]
    blocks: tuple[str, ...]

    @property
    def steps(self) -> int:
        return math.prod(self.grid)


@dataclasses.dataclass(frozen=True)
class KernelProfile:
    """One Pallas call compiled alone with the static profile on.

    Attributes:
      index: its position among the program's Pallas calls (`pallas_equations` order).
      name: the Pallas call's name (`call_name`).
      cycles, vmem_bytes: its estimated cycles and the scoped VMEM Mosaic reserved.
      seconds: CPU time of its compile (on an idle machine about its wall time; unlike the wall time,
        not stretched by other work on the machine).
      base_bytes, peak_bytes: resident memory of the compiling process before the compile and at its peak.
      error: why the compile failed ("" when it did not; cycles and vmem are then 0).
      over_memory: the compile was killed for exceeding the job's memory reservation.
      steps: its grid's number of steps.
      schedule: with a job's "schedule", what bounds its cycles (`gla_core.llo_schedule.ScheduleSummary`
        as JSON), or None; schedule_error: why there is none.
    """

    index: int
    name: str
    cycles: int
    vmem_bytes: int
    seconds: float = 0.0
    base_bytes: int = 0
    peak_bytes: int = 0
    error: str = ""
    over_memory: bool = False
    steps: int = 0
    schedule: dict | None = None
    schedule_error: str = ""


@dataclasses.dataclass(frozen=True)
class ProgramProfile:
    """The static estimate of one compiled program.

    Attributes:
      chip: "v5e" or "v6e".
      kernel_cycles: estimated cycles of every Pallas kernel, by the kernel's name (a name that
        occurs several times is summed).
      xla_ops: the other top-level XLA ops with the bytes they write and their cycles.
      argument_bytes, output_bytes, temp_bytes: XLA's memory analysis of the program.
      kernel_vmem: scoped VMEM bytes Mosaic reserved for every Pallas kernel, by name (the
        largest when a name occurs several times).
      pallas_calls: how many Pallas calls the traced program makes (0 when not counted).
    """

    chip: str
    kernel_cycles: dict[str, int]
    xla_ops: tuple[XlaOp, ...]
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    kernel_vmem: dict[str, int] = dataclasses.field(default_factory=dict)
    pallas_calls: int = 0

    @property
    def pallas_cycles(self) -> int:
        return sum(self.kernel_cycles.values())

    @property
    def xla_cycles(self) -> int:
        """Estimated cycles of the top-level XLA ops around the kernels."""
        return sum(op.cycles for op in self.xla_ops)

    @property
    def xla_bytes(self) -> int:
        """Bytes written by the top-level XLA ops around the kernels."""
        return sum(op.bytes_written for op in self.xla_ops)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ProgramProfile:
        return cls(**{**data, "xla_ops": tuple(XlaOp(**op) for op in data["xla_ops"])})


@dataclasses.dataclass(frozen=True)
class StubbedProgram:
    """A program compiled around empty kernels: its XLA side (a `ProgramProfile` without kernel
    cycles), the Pallas calls it makes, in program order, and `probe`: the index j of the first pair of
    its probe candidates (j, j + 1) that make the same calls (`same_kernels`), None if none does."""

    profile: ProgramProfile
    calls: tuple[KernelCall, ...]
    probe: int | None = None


def same_kernels(full: Sequence[KernelCall], probe: Sequence[KernelCall]) -> bool:
    """Whether a probe makes the same Pallas calls with the same blocks as the full program (only the
    grids differ): the same work per grid step."""
    return len(full) == len(probe) and all(
        (a.name, a.blocks) == (b.name, b.blocks) for a, b in zip(full, probe, strict=True)
    )


def _grids_grow(smaller: Sequence[KernelCall], larger: Sequence[KernelCall]) -> bool:
    """Whether every call of `larger` runs more grid steps than the same call of `smaller`."""
    return all(math.prod(a.grid) < math.prod(b.grid) for a, b in zip(smaller, larger, strict=True))


def first_matching_pair(
    full: Sequence[KernelCall], calls_of: Callable[[int], Sequence[KernelCall] | None], count: int
) -> int | None:
    """The first j < count - 1 such that candidates j and j + 1 both make the same calls as `full`
    (`calls_of(j)`: candidate j's calls, None when it does not trace) and every call of j + 1 runs more
    grid steps than in j (a pair that pads to the same grid, e.g. T = 128 and 256 with blocks of 256
    tokens, gives no slope), asking only for the candidates needed to find it; None when no pair does."""
    for j in range(count - 1):
        first = calls_of(j)
        if first is None or not same_kernels(full, first):
            continue
        second = calls_of(j + 1)
        if second is not None and same_kernels(full, second) and _grids_grow(first, second):
            return j
    return None


def with_kernels(whole: ProgramProfile, kernels: Sequence[KernelProfile]) -> ProgramProfile:
    """`whole` (the XLA side of a program) with the cycles and scoped VMEM of its Pallas calls
    profiled one by one (cycles of a repeated name are summed, the largest VMEM kept)."""
    cycles: dict[str, int] = {}
    vmem: dict[str, int] = {}
    for kernel in kernels:
        cycles[kernel.name] = cycles.get(kernel.name, 0) + kernel.cycles
        vmem[kernel.name] = max(vmem.get(kernel.name, 0), kernel.vmem_bytes)
    return dataclasses.replace(whole, kernel_cycles=cycles, kernel_vmem=vmem)


def _tuple_elements(result_type: str) -> list[str]:
    """The top-level elements of a tuple type "(a, b, ...)" (the type itself if it is no tuple)."""
    text = result_type.strip()
    if not text.startswith("("):
        return [text]
    elements, depth, start = [], 0, 1
    for i, char in enumerate(text):
        depth += 1 if char in "({[" else -1 if char in ")}]" else 0
        if (char == "," and depth == 1) or (char == ")" and depth == 0):
            elements.append(text[start:i].strip())
            start = i + 1
    return elements


def _written(opcode: str, result_type: str) -> str:
    """The part of an instruction's result that it writes. An asynchronous `*-start` op returns a
    tuple of its operand, its output (in either order) and a context scalar: its output is the
    array element in an on-chip memory space if there is one (a prefetch), else the largest."""
    if not opcode.endswith("-start"):
        return result_type
    arrays = [e for e in _tuple_elements(result_type) if _shape_bytes(e) > 4]
    on_chip = [e for e in arrays if _is_on_chip(e)]
    return (on_chip or sorted(arrays, key=_shape_bytes)[-1:] or [result_type])[0]


def _is_on_chip(result_type: str) -> bool:
    """Whether every array of an HLO result type lives in a non-default memory space (S(n), n > 0)."""
    layouts = re.findall(r"\{[^{}]*\}", result_type)
    arrays = [layout for layout in layouts if ":" in layout or "S(" in layout]
    return bool(arrays) and all(re.search(r"S\([1-9]\d*\)", layout) for layout in arrays)


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        count = 1
        for dim in filter(None, dims.split(",")):
            count *= int(dim)
        total += count * _BYTES.get(dtype, 4)
    return total


def entry_instructions(hlo_text: str) -> list[tuple[str, str, str, str]]:
    """(name, opcode, result type text, whole line) of every instruction of the entry computation."""
    lines = hlo_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    found = []
    for line in lines[start + 1 :]:
        if line.startswith("}"):
            break
        match = _INSTRUCTION.match(line)
        if match:
            found.append((match.group(1), match.group(3), match.group(2), line))
    return found


def kernel_name(instruction: str) -> str:
    """The kernel an HLO instruction name stands for (XLA's ".N" uniquifying suffix dropped)."""
    return re.sub(r"\.\d+$", "", instruction)


def profile_from(
    hlo_text: str, cycles_by_op: dict[str, int], memory: dict, chip: str, pallas_calls: int = 0
) -> ProgramProfile:
    """Joins the compiled HLO with the static profile's cycles per op name."""
    kernels: dict[str, int] = {}
    vmem: dict[str, int] = {}
    xla_ops = []
    for name, opcode, result_type, line in entry_instructions(hlo_text):
        cycles = cycles_by_op.get(name, 0)
        if is_mosaic_call(line):
            kernel = kernel_name(name)
            kernels[kernel] = kernels.get(kernel, 0) + cycles
            vmem[kernel] = max(vmem.get(kernel, 0), scoped_vmem_bytes(line))
        elif opcode not in _FREE_OPCODES and not _is_on_chip(_written(opcode, result_type)):
            xla_ops.append(XlaOp(name, opcode, _shape_bytes(_written(opcode, result_type)), cycles))
    return ProgramProfile(chip, kernels, tuple(xla_ops), **memory, kernel_vmem=vmem, pallas_calls=pallas_calls)


def parse_profiles(directory: pathlib.Path) -> dict[str, int]:
    """Estimated cycles per HLO op name, from the profiles libtpu wrote into `directory`."""
    cycles: dict[str, int] = {}
    for path in sorted(directory.glob("*static_llo_profile*")):
        for name, value in _ESTIMATE.findall(path.read_text()):
            cycles[name] = cycles.get(name, 0) + int(value)
    return cycles


def _failure(output: str) -> str:
    """The line of a failed compile's output that says why (a check failure or the exception, without
    its log prefix), else its tail."""
    lines = [_LOG_PREFIX.sub("", line.strip()) for line in output.strip().splitlines() if line.strip()]
    for marker in ("Check failed", "Error:", "Error"):
        found = [line for line in lines if marker in line and "TPU_WORKER_HOSTNAMES" not in line]
        if found:
            return found[-1][:400]
    return " | ".join(lines[-3:])[:400]


def _read_lines(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _resident_bytes(pid: int) -> int:
    """Resident memory of process `pid` (0 once it has exited)."""
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    found = re.search(r"VmRSS:\s+(\d+)", status)
    return int(found.group(1)) * 1024 if found else 0


def _run_watched(
    command: list[str], env: dict, log: pathlib.Path, timeout: float, memory_limit: int | None
) -> tuple[str, bool]:
    """Runs `command` with its output in `log`; kills it when it outlives `timeout` seconds or its resident
    memory exceeds `memory_limit` bytes. Returns ("", False) when it exited with 0, else (why it did not,
    whether it was killed for its memory)."""
    with open(log, "w") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while True:
        try:
            code = process.wait(timeout=_WATCH_SECONDS)
        except subprocess.TimeoutExpired:
            resident = _resident_bytes(process.pid)
            over_memory = memory_limit is not None and resident > memory_limit
            if not over_memory and time.monotonic() < deadline:
                continue
            process.kill()
            process.wait()
            if over_memory:
                limit = memory_limit / GIB
                return f"killed at {resident / GIB:.1f} GiB resident, over its reservation of {limit:.1f} GiB", True
            return f"killed after {timeout:.0f} s, over its time limit", False
        return ("", False) if code == 0 else (f"exit code {code}: {_failure(log.read_text(errors='replace'))}", False)


def run_job(job: dict, *, memory_limit: int | None = None, timeout: float = DEFAULT_TIMEOUT) -> list[dict]:
    """Runs a compile job (see the module docstring) in subprocesses and returns its result records.

    `job`: {"mode": "whole" | "stub" | "kernels", "chip", "programs": [spec, ...], "profile": bool
    (default: True unless "stub"), "probes": [[spec, ...], ...] (stub mode: per program, its probe
    candidates, see `StubbedProgram.probe`), "only": [[program, kernel], ...] (kernels mode: compile
    only these), "schedule": bool (kernels mode: also dump each kernel's schedule and summarize it,
    `gla_core.llo_schedule`)}. A subprocess is
    killed when its resident memory exceeds `memory_limit` bytes or it runs longer than `timeout`
    seconds. A kernels job whose subprocess dies (an abort in libtpu, or killed) is resumed after the
    kernel it was compiling, which gets a record with its "error"; any other failure raises `ProfileError`.
    """
    profile = job.get("profile", job["mode"] != "stub")
    failed: list[dict] = []
    done: list[dict] = []
    while True:
        with tempfile.TemporaryDirectory() as tmp:
            directory = pathlib.Path(tmp)
            logs = directory / "tpu-logs"  # a crashing profiled compile logs gigabytes; they go with the directory
            logs.mkdir()
            env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_SKIP_MDS_QUERY="1", TPU_LOG_DIR=str(logs))
            if profile:
                env["LIBTPU_INIT_ARGS"] = profile_flags(directory / "profiles")
            if job.get("schedule"):
                flags = (f"--xla_jf_dump_to={directory / 'llo'}", *llo_schedule.SCHEDULE_FLAGS)
                env["LIBTPU_INIT_ARGS"] = " ".join([env.get("LIBTPU_INIT_ARGS", ""), *flags]).strip()
            skip = [[r["program"], r["kernel"]] for r in done + failed if "kernel" in r]
            command = [sys.executable, "-m", "gla_core.static_profile", json.dumps({**job, "skip": skip}), tmp]
            why, over_memory = _run_watched(command, env, directory / "output.log", timeout, memory_limit)
            records = _read_lines(directory / "results.jsonl")
            started = _read_lines(directory / "started.jsonl")
        done += records
        if not why:
            return done + failed
        finished = {(r["program"], r.get("kernel")) for r in records}
        crashed = [s for s in started if (s["program"], s.get("kernel")) not in finished]
        if job["mode"] != "kernels" or not crashed:
            raise ProfileError(f"{job['mode']} compile failed: {why}", over_memory)
        failed.append({**crashed[-1], "error": why, "over_memory": over_memory, "cycles": 0, "vmem_bytes": 0})


NO_ESTIMATE = "libtpu's static profile estimated 0 cycles for it: no estimate, not a free kernel"


def kernel_measurement(cycles: int, vmem_bytes: int, **extra) -> dict:
    """The result record of one kernel compiled alone; an estimate of 0 cycles (libtpu writes one for
    some kernels it does not model) is a failure with `NO_ESTIMATE`, never a kernel that costs nothing."""
    record = {"cycles": cycles, "vmem_bytes": vmem_bytes, **extra}
    if cycles <= 0:
        record["error"] = NO_ESTIMATE
    return record


def _call_from(data: dict) -> KernelCall:
    return KernelCall(data["name"], tuple(data["grid"]), tuple(data["blocks"]))


def _kernel_profiles(records: Sequence[dict], program: int) -> list[KernelProfile]:
    """The `KernelProfile`s of one program's records, in program order."""
    fields = {f.name for f in dataclasses.fields(KernelProfile)} - {"index"}
    chosen = sorted((r for r in records if r["program"] == program), key=lambda r: r["kernel"])
    return [KernelProfile(index=r["kernel"], **{k: v for k, v in r.items() if k in fields}) for r in chosen]


def _stubbed(record: dict) -> StubbedProgram:
    calls = tuple(map(_call_from, record["calls"]))
    return StubbedProgram(ProgramProfile.from_json(record["profile"]), calls, record.get("probe"))


def stub_programs(
    specs: Sequence[dict], chip: str, probes: Sequence[Sequence[dict]] = (), memory_limit: int | None = None
) -> list[StubbedProgram]:
    """Every program of `specs` compiled around empty kernels for `chip`, in one subprocess, with the
    first pair of its probe candidates `probes[i]` (traced only) that makes its calls."""
    job = {"mode": "stub", "chip": chip, "programs": list(specs), "probes": [list(p) for p in probes]}
    records = {r["program"]: r for r in run_job(job, memory_limit=memory_limit)}
    return [_stubbed(records[i]) for i in range(len(specs))]


def profile_kernels(
    specs: Sequence[dict], chip: str, only: Sequence[tuple[int, int]] | None = None, memory_limit: int | None = None
) -> list[list[KernelProfile]]:
    """Every Pallas call of every program of `specs` (or `only` the (program, kernel) pairs given)
    compiled alone for `chip` with the static profile on, in one subprocess (resumed after a kernel
    that aborts it or is killed for exceeding `memory_limit`): per program, its kernels' profiles in
    program order."""
    job = {"mode": "kernels", "chip": chip, "programs": list(specs)}
    if only is not None:
        job["only"] = [list(pair) for pair in only]
    records = run_job(job, memory_limit=memory_limit)
    return [_kernel_profiles(records, i) for i in range(len(specs))]


def schedule_kernels(spec: dict, memory_limit: int | None = None) -> list[KernelProfile]:
    """Every Pallas call of the program `spec` describes compiled alone, with its estimated cycles
    and what bounds them (`KernelProfile.schedule`, `gla_core.llo_schedule`), in program order."""
    job = {"mode": "kernels", "chip": spec["chip"], "programs": [spec], "schedule": True}
    return _kernel_profiles(run_job(job, memory_limit=memory_limit), 0)


def profile_program(spec: dict, memory_limit: int | None = None) -> ProgramProfile:
    """The program `spec` describes (with its own "chip"), compiled whole with the static profile on."""
    (record,) = run_job({"mode": "whole", "chip": spec["chip"], "programs": [spec]}, memory_limit=memory_limit)
    return ProgramProfile.from_json(record["profile"])


def profile_by_kernel(spec: dict) -> ProgramProfile:
    """`profile_program(spec)` assembled from the program compiled around empty kernels (the XLA side
    and the memory analysis) and every Pallas call profiled alone (two subprocesses). A whole
    profiled program can take more memory than a small machine has; its kernels alone take less."""
    chip = spec["chip"]
    (stubbed,) = stub_programs([spec], chip)
    (kernels,) = profile_kernels([spec], chip)
    failures = [f"{k.name}: {k.error}" for k in kernels if k.error]
    if failures:
        raise ProfileError("; ".join(failures))
    return with_kernels(stubbed.profile, kernels)


def calibrate_clock(chip: str, memory_limit: int | None = None) -> float:
    """Cycles per second of the static model on `chip`: the static cycles of a 4096^3 bfloat16 matmul
    (`CALIBRATION_SIZE`), compiled whole in a subprocess, over its time at the chip's peak bfloat16 rate."""
    profile = profile_program({"program": "matmul", "size": CALIBRATION_SIZE, "chip": chip}, memory_limit)
    return profile.xla_cycles / (2 * CALIBRATION_SIZE**3 / PEAK_BF16_FLOPS[chip])


# ---- the subprocess side -------------------------------------------------------------------------


def _traced(spec: dict, chip: str):
    """The closed jaxpr of the program of `spec` (traced for TPU `chip`) and its argument structs."""
    import jax

    from gla_core.cost import build_program
    from gla_core.overrides import use

    fn, structs = build_program(spec)
    with use(backend="tpu", interpret=False, chip=chip):
        return jax.make_jaxpr(fn)(*structs), structs


def call_name(eqn) -> str:
    """A `pallas_call`'s name; for an unnamed call, its kernel's file and line ("gdn2_fwd.py:92")."""
    if eqn.params.get("name"):
        return str(eqn.params["name"])
    source = getattr(getattr(eqn.params["jaxpr"], "debug_info", None), "func_src_info", None) or "pallas_call"
    return source.rsplit("/", 1)[-1]


def kernel_call(eqn) -> KernelCall:
    """The `KernelCall` of a `pallas_call` equation."""
    mapping = eqn.params["grid_mapping"]
    blocks = tuple(str(tuple(block.block_shape)) for block in mapping.block_mappings)
    return KernelCall(call_name(eqn), tuple(int(n) for n in mapping.grid), blocks)


def _kernel_program(eqn):
    """A Pallas call equation as a program of its own: (fn, argument structs)."""
    import jax
    from jax._src import core

    if not all(isinstance(v, core.Var) for v in eqn.invars):
        raise ProfileError(f"{eqn.params['name']}: a Pallas call with literal operands cannot be compiled alone")
    alone = core.ClosedJaxpr(core.Jaxpr([], list(eqn.invars), list(eqn.outvars), [eqn]), [])
    structs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    return core.jaxpr_as_fun(alone), structs


def _peak_reset() -> int:
    """Resets this process's peak resident memory (VmHWM) to its current resident memory, so the
    next compile's peak can be read, and returns that resident memory."""
    with open("/proc/self/clear_refs", "w") as stream:
        stream.write("5")
    return _resident_bytes(os.getpid())


def _peak_bytes() -> int:
    status = pathlib.Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) * 1024


def _lower(fn, structs, chip: str, donate=()):
    import jax

    from gla_core.overrides import use
    from gla_core.tpu_checks import compile_only_device

    device = compile_only_device(chip)
    sharding = jax.sharding.SingleDeviceSharding(device)
    placed = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in structs]
    # The default device makes Pallas's lowering checks see the target chip, not this host.
    with use(backend="tpu", interpret=False, chip=chip), jax.default_device(device):
        return jax.jit(fn, donate_argnums=donate).lower(*placed)


def _memory(compiled) -> dict:
    memory = compiled.memory_analysis()
    return {
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "temp_bytes": int(memory.temp_size_in_bytes),
    }


class _Worker:
    """Runs one job in this process, appending a line per result to OUT_DIR/results.jsonl (and one
    per compile started to OUT_DIR/started.jsonl, so a parent can tell which compile aborted)."""

    def __init__(self, job: dict, out_dir: str):
        self.job, self.chip = job, job["chip"]
        self.out = pathlib.Path(out_dir)
        self.profiles = self.out / "profiles"
        self.profiles.mkdir(exist_ok=True)
        self.skip = {tuple(pair) for pair in job.get("skip", ())}
        self.only = None if "only" not in job else {tuple(pair) for pair in job["only"]}
        self.compiled: dict[str, dict] = {}  # lowered program text hash -> its record

    def _write(self, name: str, record: dict) -> None:
        with open(self.out / name, "a") as stream:
            stream.write(json.dumps(record) + "\n")

    def _cycles(self) -> dict[str, int]:
        """The cycles libtpu wrote since the last call (the profiles are removed once read)."""
        cycles = parse_profiles(self.profiles)
        for path in self.profiles.glob("*"):
            path.unlink()
        return cycles

    def _schedule(self, hlo_name: str, step_cycles: int) -> dict:
        """With the job's "schedule", the summary of the kernel just compiled, whose grid steps take
        `step_cycles` each (its dumps are removed once read)."""
        if not self.job.get("schedule"):
            return {}
        dumps = self.out / "llo"
        try:
            return {"schedule": llo_schedule.summarize_dump(dumps, hlo_name, step_cycles).to_json()}
        except llo_schedule.ScheduleError as error:
            return {"schedule_error": str(error)}
        finally:
            shutil.rmtree(dumps, ignore_errors=True)

    def run(self) -> None:
        from jax._src import core

        from gla_core.pallas_jaxpr import stub_kernels

        for index, spec in enumerate(self.job["programs"]):
            closed, structs = _traced(spec, self.chip)
            eqns = pallas_equations(closed.jaxpr)
            donate = tuple(spec.get("donate_argnums", ()))  # e.g. a decode step's state pool
            if self.job["mode"] == "kernels":
                self._kernels(index, eqns)
                continue
            self._write("started.jsonl", {"program": index})
            program = stub_kernels(closed) if self.job["mode"] == "stub" else closed
            lowered = _lower(core.jaxpr_as_fun(program), structs, self.chip, donate)
            compiled = lowered.compile()
            profile = profile_from(compiled.as_text(), self._cycles(), _memory(compiled), self.chip, len(eqns))
            calls = [kernel_call(eqn) for eqn in eqns]
            record = {"program": index, "profile": profile.to_json(), "calls": [dataclasses.asdict(c) for c in calls]}
            if self.job.get("probes"):
                record["probe"] = self._probe(calls, self.job["probes"][index])
            self._write("results.jsonl", record)

    def _probe(self, calls: list[KernelCall], candidates: list[dict]) -> int | None:
        """`first_matching_pair` of the probe candidates, each traced when it is needed."""

        @functools.cache
        def calls_of(j: int) -> list[KernelCall] | None:
            try:
                closed, _ = _traced(candidates[j], self.chip)
            except Exception:  # a program that does not trace at this shape: no probe there
                return None
            return [kernel_call(eqn) for eqn in pallas_equations(closed.jaxpr)]

        return first_matching_pair(calls, calls_of, len(candidates))

    def _kernels(self, program: int, eqns) -> None:
        for index, eqn in enumerate(eqns):
            key = (program, index)
            if key in self.skip or (self.only is not None and key not in self.only):
                continue
            fn, structs = _kernel_program(eqn)
            lowered = _lower(fn, structs, self.chip)
            digest = hashlib.sha256(lowered.as_text().encode()).hexdigest()
            described = {"program": program, "kernel": index, "name": call_name(eqn)}
            if digest in self.compiled:  # the same kernel on the same shapes: nothing new to compile
                self._write("results.jsonl", {**described, **self.compiled[digest]})
                continue
            self._write("started.jsonl", described)
            base = _peak_reset()
            start = time.process_time()
            compiled = lowered.compile()
            seconds = time.process_time() - start
            alone = profile_from(compiled.as_text(), self._cycles(), _memory(compiled), self.chip)
            ((hlo_name, cycles),) = alone.kernel_cycles.items()
            (vmem,) = alone.kernel_vmem.values()
            steps = kernel_call(eqn).steps
            extra = {"steps": steps, **self._schedule(hlo_name, cycles // max(steps, 1))}
            measured = kernel_measurement(
                cycles, vmem, seconds=seconds, base_bytes=base, peak_bytes=_peak_bytes(), **extra
            )
            self.compiled[digest] = measured
            self._write("results.jsonl", {**described, **measured})


if __name__ == "__main__":
    _Worker(json.loads(sys.argv[1]), sys.argv[2]).run()
