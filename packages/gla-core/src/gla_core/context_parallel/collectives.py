"""The collectives of a compiled program and the bytes each device receives through them.

Reads XLA's compiled HLO text (`jax.jit(f).lower(...).compile().as_text()`), e.g. of a
context-parallel training step compiled for compile-only TPU devices. Bytes per device follow the
ring algorithms of a 1-D device group of size G (what a TPU torus axis runs): an all-gather of a
result of R bytes brings (G - 1) / G * R to each device; a reduce-scatter of R-byte inputs,
(G - 1) / G * R; an all-reduce, twice that; a collective-permute, its R bytes to each target.
"""

from __future__ import annotations

import dataclasses
import math
import re

ITEMSIZE = {
    "f64": 8,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "s8": 1,
    "u8": 1,
    "pred": 1,
}
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<shape>.+?) (?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\("
)
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?(?P<name>[\w.\-]+) \(.*\) -> .*\{$")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program.

    Attributes:
      kind: "all-gather", "all-reduce", "reduce-scatter" (also an all-reduce fused with a
        dynamic-slice, XLA TPU's all-reduce-scatter), "collective-permute" or "all-to-all".
      name: the HLO instruction's name.
      arrays: its per-device arrays as (dtype, shape): the gathered result of an all-gather, the
        reduced arrays of an all-reduce and of a reduce-scatter (before scattering), the message
        of a collective-permute.
      group_size: G, the devices of each group (replica_groups), or of the permutation.
      pairs: collective-permute only: its (source, target) pairs.
      backward: it comes from the transposed (backward) part of the program (JAX's op_name says
        `transpose(...)`); None for a collective XLA made itself (combined all-reduces,
        all-reduce-scatters), which carries no op_name.
    """

    kind: str
    name: str
    arrays: tuple[tuple[str, tuple[int, ...]], ...]
    group_size: int
    pairs: tuple[tuple[int, int], ...] = ()
    backward: bool | None = None

    @property
    def array_bytes(self) -> int:
        """Bytes of `arrays` on one device."""
        return sum(ITEMSIZE[dtype] * math.prod(shape) for dtype, shape in self.arrays)

    @property
    def bytes_received(self) -> int:
        """Bytes one device receives (a target device, for a collective-permute)."""
        share = self.array_bytes * (self.group_size - 1) // self.group_size
        return {"all-reduce": 2 * share, "collective-permute": self.array_bytes}.get(self.kind, share)

    def describe(self) -> str:
        arrays = ", ".join(f"{dtype}{list(shape)}" for dtype, shape in self.arrays)
        where = f"pairs {list(self.pairs)}" if self.kind == "collective-permute" else f"groups of {self.group_size}"
        part = {True: "backward", False: "forward", None: "made by XLA"}[self.backward]
        return f"{self.kind} {arrays} ({where}, {part}): {self.bytes_received / 2**20:.3f} MiB received per device"


def collectives(hlo_text: str) -> tuple[Collective, ...]:
    """Every collective of a compiled program, in program order (async -start/-done pairs once)."""
    found, computation = [], ""
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header is not None:
            computation = header.group("name")
            continue
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        kind = match.group("kind")
        arrays = tuple((dtype, _dims(dims)) for dtype, dims in _ARRAY.findall(match.group("shape")))
        if match.group("start"):  # (operand, result[, contexts]): keep the result of a gather, else the operand
            arrays = arrays[1:2] if kind == "all-gather" else arrays[:1]
        if kind == "all-reduce" and "all-reduce-scatter" in computation:
            kind = "reduce-scatter"
        op_name = _OP_NAME.search(line)
        found.append(
            Collective(
                kind=kind,
                name=match.group("name"),
                arrays=arrays,
                group_size=_group_size(line),
                pairs=_pairs(line),
                backward=None if op_name is None else "transpose(" in op_name.group(1),
            )
        )
    return tuple(found)


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d)


def _group_size(line: str) -> int:
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if listed is not None:
        return len([d for d in listed.group(1).split(",") if d])
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    if iota is not None:
        return int(iota.group(2))
    return 2  # a collective-permute: one sender, one receiver per pair


def _pairs(line: str) -> tuple[tuple[int, int], ...]:
    listed = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    if listed is None:
        return ()
    return tuple(tuple(int(d) for d in pair.split(",")) for pair in re.findall(r"\{(\d+,\d+)", listed.group(1) + "}"))
