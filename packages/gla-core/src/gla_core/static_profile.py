"""What libtpu's static cost model says about one compiled TPU program, without a TPU.

libtpu writes a static LLO profile, the estimated cycles of every HLO op of a program (Mosaic
kernels included), when `LIBTPU_INIT_ARGS=--xla_jf_dump_static_llo_profile_to=DIR` is set at
start-up. The flag is process-wide and a failing compile can abort the process, so every
program is compiled in its own subprocess (`python -m gla_core.static_profile SPEC`, SPEC a
JSON object understood by `gla_core.cost.build_program`).

From one compile this gives (`ProgramProfile`):
  - the estimated cycles of every Pallas kernel and of every other XLA op,
  - the bytes written to HBM by top-level XLA ops other than the Pallas kernels (transposes,
    copies, pads, reductions: layout work around the kernels), read from the compiled HLO
    (asynchronous copies into on-chip memory spaces, XLA's prefetching, are not layout work),
  - XLA's memory analysis: argument, output and temp bytes.
The profile of a large program can take more memory than this machine has (it grows with the
kernels' grids and with the program); `profile_by_kernel` then compiles the program with its
Pallas calls replaced by empty kernels (`gla_core.pallas_jaxpr.stub_kernels`: the XLA side, its
bytes and the memory analysis; its cycles only when asked) and profiles every Pallas call in a
program of its own (the same call, the same operand shapes: its cycles and scoped VMEM), each
compile in its own subprocess.
Cycles become seconds with a clock calibrated in the same libtpu (`calibrate_clock`): the
estimate of a 4096^3 bfloat16 matmul over its time at the chip's peak bfloat16 rate.
These are compiler estimates, not measurements.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from gla_core.errors import GlaError
from gla_core.pallas_jaxpr import pallas_equations
from gla_core.tpu_checks import is_mosaic_call, scoped_vmem_bytes

# Public spec sheets: peak bfloat16 matmul rate (FLOP/s) and HBM bandwidth (bytes/s) per chip.
PEAK_BF16_FLOPS = {"v5e": 197e12, "v6e": 918e12}
HBM_BANDWIDTH = {"v5e": 819e9, "v6e": 1638e9}
CALIBRATION_SIZE = 4096
_ESTIMATE = re.compile(r'hlo_op_name:\s*"([^"]+)"\s*estimated_cycles:\s*(\d+)')
# Instructions that write no HBM bytes of their own.
_FREE_OPCODES = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all", "partition-id"}
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
_BYTES.update({"f64": 8, "s64": 8, "u64": 8})
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\(")


class ProfileError(GlaError, RuntimeError):
    """A profiled compile failed (its subprocess exited or aborted); the message says why."""


@dataclasses.dataclass(frozen=True)
class XlaOp:
    """A top-level XLA op of the compiled program other than a Pallas kernel."""

    name: str
    opcode: str
    bytes_written: int
    cycles: int


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

    @property
    def floor_bytes(self) -> int:
        """Argument + output bytes: what any implementation must move through HBM."""
        return self.argument_bytes + self.output_bytes

    def floor_seconds(self) -> float:
        return self.floor_bytes / HBM_BANDWIDTH[self.chip]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ProgramProfile:
        return cls(**{**data, "xla_ops": tuple(XlaOp(**op) for op in data["xla_ops"])})


def with_kernels(whole: ProgramProfile, kernels: Sequence[ProgramProfile]) -> ProgramProfile:
    """`whole` (the XLA side of a program) with the kernel cycles and scoped VMEM of `kernels`,
    the profiles of its Pallas calls compiled one by one (cycles of a repeated name are summed)."""
    cycles: dict[str, int] = {}
    vmem: dict[str, int] = {}
    for alone in kernels:
        for name, value in alone.kernel_cycles.items():
            cycles[name] = cycles.get(name, 0) + value
        for name, value in alone.kernel_vmem.items():
            vmem[name] = max(vmem.get(name, 0), value)
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


def profile_program(spec: dict, timeout: float = 1800) -> ProgramProfile:
    """Compiles the program `spec` describes in a subprocess with the static profile on.

    Keys of `spec` besides the program's own (`gla_core.cost.build_program`): `chip`;
    `profile` (default True: write the static profile); `kernel` (an index: compile only that
    Pallas call of the program, `pallas_equations` order); `stub_kernels` (compile the program
    with every Pallas call replaced by an empty kernel, `gla_core.pallas_jaxpr.stub_kernels`);
    `donate_argnums`.
    """
    with tempfile.TemporaryDirectory() as tmp:
        directory = pathlib.Path(tmp)
        logs = directory / "tpu-logs"  # a crashing profiled compile logs gigabytes; they go with the directory
        logs.mkdir()
        env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_SKIP_MDS_QUERY="1", TPU_LOG_DIR=str(logs))
        if spec.get("profile", True):
            env["LIBTPU_INIT_ARGS"] = f"--xla_jf_dump_static_llo_profile_to={directory}"
        result = directory / "result.json"
        command = [sys.executable, "-m", "gla_core.static_profile", json.dumps(spec), str(result)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode != 0 or not result.exists():
            raise ProfileError(f"profiled compile failed ({done.returncode}): {_failure(done.stderr or done.stdout)}")
        compiled = json.loads(result.read_text())
        cycles = parse_profiles(directory)
        return profile_from(compiled["hlo"], cycles, compiled["memory"], spec["chip"], compiled["pallas_calls"])


def _failure(output: str) -> str:
    """The line of a failed compile's output that says why (a check failure or the exception), else its tail."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    for marker in ("Check failed", "Error:", "Error"):
        found = [line for line in lines if marker in line and "TPU_WORKER_HOSTNAMES" not in line]
        if found:
            return found[-1][:400]
    return " | ".join(lines[-3:])[:400]


def profile_by_kernel(spec: dict, timeout: float = 1800, xla_cycles: bool = False) -> ProgramProfile:
    """`profile_program(spec)` from the program compiled around empty kernels (the XLA side and the
    memory analysis) and every Pallas call profiled in a program of its own (one subprocess after
    the other).

    `xla_cycles`: also profile the XLA side (its ops' cycles; else they are reported as 0). At the
    production shapes that profile of a training step takes more than this machine's 24 GB.
    """
    whole = profile_program({**spec, "stub_kernels": True, "profile": xla_cycles}, timeout)
    kernels = [profile_program({**spec, "kernel": index}, timeout) for index in range(whole.pallas_calls)]
    return with_kernels(whole, kernels)


def _traced(spec: dict):
    """The closed jaxpr of the program of `spec` (traced for TPU) and its argument structs."""
    import jax

    from gla_core.cost import build_program
    from gla_core.overrides import use

    fn, structs = build_program(spec)
    with use(backend="tpu", interpret=False, chip=spec["chip"]):
        return jax.make_jaxpr(fn)(*structs), structs


def _kernel_program(closed, index: int):
    """The `index`-th Pallas call of a traced program as a program of its own."""
    import jax
    from jax._src import core

    eqn = pallas_equations(closed.jaxpr)[index]
    if not all(isinstance(v, core.Var) for v in eqn.invars):
        raise ProfileError(f"kernel {index}: a Pallas call with literal operands cannot be compiled alone")
    alone = core.ClosedJaxpr(core.Jaxpr([], list(eqn.invars), list(eqn.outvars), [eqn]), [])
    structs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    return core.jaxpr_as_fun(alone), structs


def calibration_spec(chip: str) -> dict:
    return {"program": "matmul", "size": CALIBRATION_SIZE, "chip": chip}


def clock_from(profile: ProgramProfile) -> float:
    """Cycles per second of the static model, from the profile of the calibration matmul
    (`calibration_spec`): its estimate over its time at the chip's peak bfloat16 rate."""
    seconds = 2 * CALIBRATION_SIZE**3 / PEAK_BF16_FLOPS[profile.chip]
    return profile.xla_cycles / seconds


def calibrate_clock(chip: str) -> float:
    """Cycles per second of the static model on `chip` (`clock_from` of a fresh calibration compile)."""
    return clock_from(profile_program(calibration_spec(chip)))


def _compile_worker(spec: dict, result_path: str) -> None:
    import jax
    from jax._src import core

    from gla_core.overrides import use
    from gla_core.pallas_jaxpr import stub_kernels
    from gla_core.tpu_checks import compile_only_device

    closed, structs = _traced(spec)
    pallas_calls = len(pallas_equations(closed.jaxpr))
    donate = tuple(spec.get("donate_argnums", ()))  # e.g. a decode step's state pool
    if "kernel" in spec:
        fn, structs = _kernel_program(closed, spec["kernel"])
        donate = ()
    elif spec.get("stub_kernels"):
        fn = core.jaxpr_as_fun(stub_kernels(closed))
    else:
        fn = core.jaxpr_as_fun(closed)
    device = compile_only_device(spec["chip"])
    sharding = jax.sharding.SingleDeviceSharding(device)
    placed = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in structs]
    # The default device makes Pallas's lowering checks see the target chip, not this host.
    with use(backend="tpu", interpret=False, chip=spec["chip"]), jax.default_device(device):
        compiled = jax.jit(fn, donate_argnums=donate).lower(*placed).compile()
    memory = compiled.memory_analysis()
    out = {
        "hlo": compiled.as_text(),
        "pallas_calls": pallas_calls,
        "memory": {
            "argument_bytes": int(memory.argument_size_in_bytes),
            "output_bytes": int(memory.output_size_in_bytes),
            "temp_bytes": int(memory.temp_size_in_bytes),
        },
    }
    pathlib.Path(result_path).write_text(json.dumps(out))


if __name__ == "__main__":
    _compile_worker(json.loads(sys.argv[1]), sys.argv[2])
