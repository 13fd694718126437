"""Scaling a Pallas kernel's static cycles from small probe problems to the full problem.

libtpu's static estimate of a kernel is a run of its instructions with the grid unrolled, so
profiling a kernel costs time and memory in proportion to its cycles (`predict_compile`; gla's
training-step backward kernel on v6e at B=1 T=4096 H=16, 473k cycles, compiles in 53 s and 4.4 GB).
A kernel's cycles are (cost of a grid step) x (grid steps) + a small constant, and with the heads, K
and V of the full problem and the same block shapes, the grid steps grow linearly with the tokens
B*T. So every kernel is profiled on two probe problems, B=1 and T = t and 2t, with the full H, K and
V, where t is the shortest length at which every Pallas call of the program has the same name and
block shapes as at the full shape (`probe_candidates`); its cycles are fitted as a + b * tokens through
the two probes and evaluated at the full problem's tokens (`scale_cycles`). Varlen problems keep
their number of sequences. The fit is exact when a grid step costs the same at every size; how close
it comes is measured on the kernels that are also compiled at the full shape (`gla_core.cost_measure`).
"""

from __future__ import annotations

from collections.abc import Sequence

from gla_core.errors import InvalidArgumentError
from gla_core.static_profile import KernelProfile

# Probe lengths, shortest first; a probe pair is two neighbours (t, 2t).
PROBE_LENGTHS = (128, 256, 512, 1024, 2048, 4096)
# What a kernel's compile adds to its process per estimated cycle at the full shape, over what it adds
# on its larger probe: up to twice as much (gla's training-step backward on v6e, B=1 H=16: peaks of
# 1.24 GB at T=1024 and 4.4 GB at T=4096, 4.5 and 8.4 KB per cycle over a 0.7 GB process).
MEMORY_MARGIN = 2.0


def tokens(spec: dict) -> int:
    """B*T of a program spec (a varlen problem packs its sequences into B=1)."""
    return spec["batch"] * spec["seq_len"]


def probe_spec(spec: dict, seq_len: int) -> dict:
    """`spec` with one batch row of `seq_len` tokens (same heads, dims and number of sequences)."""
    return {**spec, "batch": 1, "seq_len": seq_len}


def probe_candidates(spec: dict) -> list[int]:
    """The probe lengths shorter than the full problem in tokens: a probe pair is the first two
    neighbours of this list whose programs make the same Pallas calls with the same blocks as the
    full program (`gla_core.static_profile.first_matching_pair`)."""
    return [t for t in PROBE_LENGTHS if t < tokens(spec)]


def scale_cycles(points: Sequence[tuple[int, int]], full_tokens: int) -> int:
    """Cycles at `full_tokens` on the line a + b * tokens through the two probe points
    [(tokens, cycles), (tokens, cycles)]."""
    if len(points) != 2 or points[0][0] == points[1][0]:
        raise InvalidArgumentError(f"points: expected two probes at different token counts, got {list(points)}")
    (x1, y1), (x2, y2) = points
    return round(y1 + (y2 - y1) / (x2 - x1) * (full_tokens - x1))


def predict_compile(probe: KernelProfile, cycles: int) -> tuple[int, float]:
    """(peak resident bytes, seconds) of a kernel's compile at `cycles` estimated cycles, from its
    compile on the larger probe. Both grow with the cycles the estimator runs through: the memory
    the compile adds to its process in proportion, times `MEMORY_MARGIN` (the bytes per cycle grow with
    the size), the time in proportion."""
    ratio = cycles / probe.cycles
    added = max(0, probe.peak_bytes - probe.base_bytes)
    return round(probe.base_bytes + MEMORY_MARGIN * added * ratio), probe.seconds * ratio
