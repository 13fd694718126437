"""Why a Pallas kernel takes the cycles libtpu estimates: the schedule it was compiled to.

`gla_core.static_profile` says how many cycles a kernel takes; this module says what bounds them.
With `SCHEDULE_FLAGS` in `LIBTPU_INIT_ARGS`, libtpu writes three text files per compiled kernel
(`<id>-<kernel>.1-NN-<label>.txt`):
  - `final_bundles`: the VLIW bundles in address order, each starting on a line with its address
    (`  0x17c PF: > { op ;; op }`), with comments that open and close the regions of the code
    (`/* Start region 69 */`) and the branches between them (`sbr.rel ... target = $region72`);
  - `final_hlo-static-per-bundle-utilization`: the slots each unit has per bundle (a capacity
    header) and, per bundle in the same order, the slots it uses;
  - `critical-path`: per basic block (`New basic block in region: region71 {... parent=357}`),
    the longest dependence chain through it, one instruction per line with its length in cycles to
    the block's end.

`summarize` takes the block with the longest chain that fits in a grid step (the step's body) and
the bundles of its region, without those a forward branch can jump over (`pl.when` bodies), and
reports how the units fill their slots there, the register spills, and the ops the chain spends
its cycles in. A body whose chain is nearly as long as its bundles are many is latency-bound
(dependent matrix products, each waiting for the result before it): more independent work per
step can fill it. One whose chain is much shorter is bound by a unit's slots: less work on that
unit is what shortens it. These are compiler estimates, like the cycles.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib
import re

from gla_core.errors import GlaError

# Dump only the passes read here (the full LLO dump of one kernel is hundreds of megabytes).
SCHEDULE_FLAGS = (
    "--xla_jf_dump_llo_text=true",
    "--xla_jf_dump_llo_pass_label_regex=critical-path|final_hlo-static-per-bundle-utilization|final_bundles",
)
# A body whose critical path reaches this fraction of its bundles is latency-bound.
LATENCY_BOUND_FRACTION = 0.85
_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(?:[A-Z]{2}:\s*)?:?\s*>?\s*\{")
_REGION_MARK = re.compile(r"\b(Start|End) region (\d+)")
_EMPTY_REGION = re.compile(r"Start/End empty region (\d+)")
_BRANCH = re.compile(r"\bsbr\.rel\b[^;}]*target = \$region(\d+)")
_BLOCK = re.compile(r"New basic block in region: region(\d+) \{[^}]*\bparent=(-?\d+)")
_CHAIN_STEP = re.compile(r"^\s*Length to end: (\d+), (.*)$")
_RESULT = re.compile(r"^\s*%\w+\s*=\s*")
_SPILL_STORE = re.compile(r"=\s*vst\S*\s+\[vmem:\[[^\]]*_spill\]")
_SPILL_LOAD = re.compile(r"=\s*vld\S*\s+\[vmem:\[[^\]]*_spill\]")


class ScheduleError(GlaError, ValueError):
    """A dump that cannot be read as this module expects (missing file, unknown format)."""


@dataclasses.dataclass(frozen=True)
class Utilization:
    """Per-bundle slot use: unit names, their slots per bundle, and one row of used slots per bundle."""

    units: tuple[str, ...]
    capacity: tuple[int, ...]
    rows: tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class Block:
    """One basic block of the critical-path dump: its region, the region around it, and its chain
    as (length to the block's end in cycles, instruction) from the first instruction on."""

    region: int
    parent: int
    chain: tuple[tuple[int, str], ...]

    @property
    def length(self) -> int:
        return self.chain[0][0] if self.chain else 0


@dataclasses.dataclass(frozen=True)
class ScheduleSummary:
    """What bounds one kernel's grid-step body (see the module docstring).

    Attributes:
      kernel: the kernel's HLO name.
      total_bundles: every bundle of the kernel.
      body_bundles: the bundles of the region holding the longest chain, without those a forward
        branch can jump over.
      critical_path: that chain's length in cycles.
      unit_use: per unit, mean slots used per bundle of the body.
      unit_capacity: per unit, slots per bundle.
      spill_stores, spill_loads: register spills and fills in the body.
      chain_cycles: the ops on the chain and the cycles spent in each, most first.
    """

    kernel: str
    total_bundles: int
    body_bundles: int
    critical_path: int
    unit_use: dict[str, float]
    unit_capacity: dict[str, int]
    spill_stores: int
    spill_loads: int
    chain_cycles: tuple[tuple[str, int], ...]

    @property
    def busiest_unit(self) -> str:
        """The unit whose slots the body fills most (ignoring the scalar unit)."""
        vector = {u: use / self.unit_capacity[u] for u, use in self.unit_use.items() if u != "SALU"}
        return max(vector, key=vector.get)

    @property
    def bound(self) -> str:
        """Either "latency" or "throughput: UNIT" (`LATENCY_BOUND_FRACTION`)."""
        if self.critical_path >= LATENCY_BOUND_FRACTION * self.body_bundles:
            return "latency"
        return f"throughput: {self.busiest_unit}"

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["chain_cycles"] = [list(pair) for pair in self.chain_cycles]
        return data

    @classmethod
    def from_json(cls, data: dict) -> ScheduleSummary:
        return cls(**{**data, "chain_cycles": tuple(tuple(pair) for pair in data["chain_cycles"])})


def parse_utilization(text: str) -> Utilization:
    """The per-bundle utilization dump: a `CAPACITY` header (unit names, then slots per unit) and,
    after `== UTILIZATION:`, one row of used slots per bundle."""
    head, separator, body = text.partition("== UTILIZATION:")
    if not separator:
        raise ScheduleError("utilization dump: no '== UTILIZATION:' section")
    header = [line for line in head.splitlines() if line.strip() and not line.startswith("==")]
    if len(header) < 2:
        raise ScheduleError("utilization dump: expected a line of unit names and a line of capacities")
    units = tuple(name.strip() for name in header[-2].split(","))
    capacity = tuple(int(n) for n in header[-1].split())
    if len(units) != len(capacity):
        raise ScheduleError(f"utilization dump: {len(units)} units but {len(capacity)} capacities")
    rows = tuple(tuple(int(n) for n in line.split()) for line in body.splitlines() if len(line.split()) == len(units))
    return Utilization(units, capacity, rows)


def parse_critical_paths(text: str) -> list[Block]:
    """Every basic block of the critical-path dump, in dump order."""
    blocks, region, parent, chain = [], None, None, []
    for line in text.splitlines():
        opened = _BLOCK.search(line)
        if opened:
            if region is not None:
                blocks.append(Block(region, parent, tuple(chain)))
            region, parent, chain = int(opened.group(1)), int(opened.group(2)), []
            continue
        step = _CHAIN_STEP.match(line)
        if step and region is not None:
            chain.append((int(step.group(1)), step.group(2)))
    if region is not None:
        blocks.append(Block(region, parent, tuple(chain)))
    return blocks


def bundle_lines(text: str) -> list[str]:
    """The bundles of a `final_bundles` dump, index = address: a bundle starts at a line with its
    address (`  0x17c PF: > {`, the first `     0   :`) and runs on over lines that have none
    (long comments)."""
    bundles: list[str] = []
    for line in text.splitlines():
        start = _BUNDLE.match(line)
        if start:
            address = int(start.group(1), 0)
            if address != len(bundles):
                raise ScheduleError(f"final bundles: bundle {len(bundles)} expected, address {address} found")
            bundles.append(line)
        elif bundles:
            bundles[-1] += " " + line.strip()
    return bundles


def region_spans(bundles: list[str]) -> dict[int, tuple[int, int]]:
    """Per region, its first and last bundle (inclusive), from the region comments (an empty
    region, `Start/End empty region N`, spans its one bundle)."""
    starts, spans = {}, {}
    for index, line in enumerate(bundles):
        for region in _EMPTY_REGION.findall(line):
            spans.setdefault(int(region), (index, index))
        for kind, region in _REGION_MARK.findall(_EMPTY_REGION.sub("", line)):
            region = int(region)
            if kind == "Start":
                starts.setdefault(region, index)
            else:
                spans[region] = (starts.get(region, index), index)
    return spans


def skippable(bundles: list[str], spans: dict[int, tuple[int, int]], first: int, last: int) -> set[int]:
    """The bundles of `first..last` that a forward branch inside that range can jump over (`pl.when`
    bodies): those after a bundle with `sbr.rel ... target = $regionN` and before region N starts.
    Backward branches close loops and skip nothing."""
    skipped = set()
    for index in range(first, last + 1):
        for region in _BRANCH.findall(bundles[index]):
            target = spans.get(int(region), (None,))[0]
            if target is not None and index + 1 < target <= last:
                skipped.update(range(index + 1, target))
    return skipped


def opcode(instruction: str) -> str:
    """An instruction's opcode family: its first two dotted parts (`vmatmul.mubr`, `vadd.f32`)."""
    result = _RESULT.match(instruction)
    tokens = instruction[result.end() :].split() if result else instruction.split()
    return ".".join(tokens[0].split(".")[:2]) if tokens else "?"


def chain_cycles(block: Block) -> tuple[tuple[str, int], ...]:
    """Cycles on the block's chain per opcode family: each instruction's length to the end minus
    the next one's (the last instruction's own length), most first."""
    cycles = collections.Counter()
    lengths = [length for length, _ in block.chain] + [0]
    for (length, instruction), following in zip(block.chain, lengths[1:], strict=True):
        cycles[opcode(instruction)] += length - following
    return tuple(cycles.most_common())


def summarize(
    kernel: str, bundles_text: str, utilization_text: str, critical_path_text: str, step_cycles: int | None = None
) -> ScheduleSummary:
    """The `ScheduleSummary` of one kernel from its three dumps (see the module docstring).

    step_cycles: the estimated cycles of one grid step, if known. libtpu does not charge the bodies
    of `pl.when` branches it models as not taken (a kernel's rarely needed exact recompute); their
    chains can be longer than a whole step, so only blocks whose chain fits in a step are taken.
    """
    bundles = bundle_lines(bundles_text)
    utilization = parse_utilization(utilization_text)
    blocks = parse_critical_paths(critical_path_text)
    if not bundles or not blocks:
        raise ScheduleError(f"{kernel}: no bundles or no basic blocks in its dumps")
    if len(utilization.rows) < len(bundles):
        raise ScheduleError(f"{kernel}: {len(utilization.rows)} utilization rows for {len(bundles)} bundles")
    charged = [block for block in blocks if step_cycles is None or block.length <= step_cycles] or blocks
    longest = max(charged, key=lambda block: block.length)
    spans = region_spans(bundles)
    first, last = spans.get(longest.region, (0, len(bundles) - 1))
    body = sorted(set(range(first, last + 1)) - skippable(bundles, spans, first, last))
    rows = [utilization.rows[i] for i in body]
    count = max(len(rows), 1)
    use = {unit: sum(row[u] for row in rows) / count for u, unit in enumerate(utilization.units)}
    lines = [bundles[i] for i in body]
    return ScheduleSummary(
        kernel=kernel,
        total_bundles=len(bundles),
        body_bundles=len(rows),
        critical_path=longest.length,
        unit_use=use,
        unit_capacity=dict(zip(utilization.units, utilization.capacity, strict=True)),
        spill_stores=sum(len(_SPILL_STORE.findall(line)) for line in lines),
        spill_loads=sum(len(_SPILL_LOAD.findall(line)) for line in lines),
        chain_cycles=chain_cycles(longest),
    )


_DUMPS = {
    "bundles": "final_bundles.txt",
    "utilization": "final_hlo-static-per-bundle-utilization.txt",
    "critical_path": "critical-path.txt",
}


def dump_files(directory: pathlib.Path, kernel: str) -> dict[str, pathlib.Path]:
    """The three dump files of kernel `kernel` (its HLO name, "kda_state" or "kda_state.1") in a
    libtpu dump directory."""
    found = {}
    for key, suffix in _DUMPS.items():
        named = re.compile(rf"-{re.escape(kernel)}(\.\d+)?-\d+-{re.escape(suffix)}$")
        matches = sorted(path for path in directory.glob(f"*-{kernel}*") if named.search(path.name))
        if not matches:
            raise ScheduleError(f"{kernel}: no '*-{suffix}' dump in {directory} (has libtpu's dump format changed?)")
        found[key] = matches[-1]
    return found


def summarize_dump(directory: pathlib.Path, kernel: str, step_cycles: int | None = None) -> ScheduleSummary:
    """`summarize` of kernel `kernel` from the files libtpu dumped in `directory`."""
    files = dump_files(directory, kernel)
    texts = {key: path.read_text(errors="replace") for key, path in files.items()}
    return summarize(kernel, texts["bundles"], texts["utilization"], texts["critical_path"], step_cycles)


def render(rows: list[tuple[str, int, int, ScheduleSummary | None, str]]) -> str:
    """A markdown table of (kernel, estimated cycles, grid steps, summary or None, error) rows."""
    units = ("VALU", "MXU", "XLU", "VPOP", "EUP", "VLOAD", "VSTORE")
    head = ["kernel", "cycles", "steps", "cycles/step", "body bundles", "critical path", "bound"]
    head += [f"{u} use" for u in units] + ["spills st/ld", "chain: most cycles in"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, cycles, steps, summary, error in rows:
        cells = [name, f"{cycles:,}", f"{steps:,}", f"{cycles // max(steps, 1):,}"]
        if summary is None:
            cells += [f"no schedule: {error}"] + [""] * (len(head) - len(cells) - 1)
        else:
            cells += [f"{summary.body_bundles:,}", f"{summary.critical_path:,}", summary.bound]
            use, capacity = summary.unit_use, summary.unit_capacity
            cells += [f"{use[u]:.2f}/{capacity[u]}" if u in use else "-" for u in units]
            cells.append(f"{summary.spill_stores:,}/{summary.spill_loads:,}")
            top = summary.chain_cycles[:4]
            cells.append(", ".join(f"{op} {c:,}" for op, c in top))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
