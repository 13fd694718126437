"""Serving decode rows of the TPU cost report: libtpu's static time of one decode step against its HBM floor.

The program is `gla_core.decode.serving.serving_problem(op)` (256 sequences decoding one token each,
H = 16, K = V = 128 bf16, a float32 pool of 1024 states, updated in place through donation), compiled
for a compile-only TPU with libtpu's static profile (`gla_core.static_profile`). The floor is the
problem's own: the states read from and written to the pool plus the tokens (the pool's untouched
slots are no part of it). Static estimates, not measurements.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from gla_core.static_profile import HBM_BANDWIDTH, profile_program

DECODE_OPS = ("simple_gla", "gla", "kda")


@dataclasses.dataclass(frozen=True)
class DecodeRow:
    """One op's decode step on one chip.

    Attributes:
      op, label: the op and the serving shape in words.
      chip: "v6e" or "v5e".
      kernel_cycles: static cycles of every Pallas kernel of the step, by name.
      clock_hz: cycles per second of the static model on `chip` (`calibrate_clock`).
      floor_bytes: HBM bytes any implementation must move (`ServingProblem.hbm_floor_bytes`).
      xla_bytes: bytes written by XLA ops around the kernels; temp_bytes: XLA's temp memory.
    """

    op: str
    label: str
    chip: str
    kernel_cycles: dict[str, int]
    clock_hz: float
    floor_bytes: int
    xla_bytes: int
    temp_bytes: int

    @property
    def seconds(self) -> float:
        return sum(self.kernel_cycles.values()) / self.clock_hz

    @property
    def floor_seconds(self) -> float:
        return self.floor_bytes / HBM_BANDWIDTH[self.chip]


def decode_spec(op: str, chip: str) -> dict:
    """The `gla_core.static_profile` spec of `op`'s decode step (the pool donated)."""
    from gla_core.decode.serving import serving_problem

    return {"program": "decode", "op": op, "chip": chip, "donate_argnums": list(serving_problem(op).donate_argnums)}


def measure_decode(
    ops: Sequence[str], clock_hz: float, chip: str = "v6e", memory_limit: int | None = None
) -> list[DecodeRow]:
    """Profiles the decode step of every op in `ops` on `chip` whose static model runs at `clock_hz`
    (`calibrate_clock`), one subprocess each, killed past `memory_limit` bytes."""
    from gla_core.decode.serving import serving_problem

    rows = []
    for op in ops:
        problem = serving_problem(op)
        profile = profile_program(decode_spec(op, chip), memory_limit)
        rows.append(
            DecodeRow(
                op,
                problem.label,
                chip,
                dict(profile.kernel_cycles),
                clock_hz,
                problem.hbm_floor_bytes,
                profile.xla_bytes,
                profile.temp_bytes,
            )
        )
    return rows


def render_decode(rows: Sequence[DecodeRow]) -> list[str]:
    """The report's serving decode section (markdown lines; none without rows)."""
    if not rows:
        return []
    lines = [
        "## Serving decode: one step with a state pool",
        "",
        "`gla_core.decode.serving.serving_problem(op)`: 256 sequences decoding one token each, H=16 K=V=128 bf16, "
        "a float32 pool of 1024 states updated in place (donated). HBM floor: the states read and written and the "
        "tokens. Pallas time: libtpu's static cycle estimate of the whole step over the chip's calibrated clock "
        "(a ratio below 1 means the static model charges the kernel's DMAs less than the bytes they move).",
        "",
        "| op | chip | kernels (static cycles) | Pallas static time | HBM floor | ratio | XLA bytes MiB | temp MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        kernels = ", ".join(f"{name} {cycles:,}" for name, cycles in sorted(row.kernel_cycles.items()))
        lines.append(
            f"| {row.op} | {row.chip} | {kernels} | {row.seconds * 1e6:.0f} us | {row.floor_seconds * 1e6:.0f} us "
            f"| {row.seconds / row.floor_seconds:.2f} | {row.xla_bytes / 2**20:.1f} | {row.temp_bytes / 2**20:.1f} |"
        )
    lines.append("")
    return lines
