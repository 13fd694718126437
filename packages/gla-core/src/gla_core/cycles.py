"""Static cycle estimates of Pallas kernels from libtpu, extrapolated to production lengths.

libtpu writes its static LLO profile (estimated cycles per HLO op, Mosaic kernels included)
when `LIBTPU_INIT_ARGS=--xla_jf_dump_static_llo_profile_to=DIR` is set at start-up. The flag
is process-wide and a failing compile can abort the process, so each compile runs in a
subprocess. Large grids are slow to compile (the profile of a B=2, H=16 gla kernel at T=1024
took over 14 GB and 15 minutes), so every kernel is compiled on a small grid, one batch row
and one head (`FIT_BATCH`, `FIT_HEADS`), at a few sequence lengths; its cycles are fitted
linearly in T and extrapolated linearly in grid steps, which grow as B * H * T. The fit and
its points are reported. Compiler estimates, not measurements.
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

import numpy as np

FIT_SEQ_LENS = (512, 1024, 2048)
# The module whose `__main__` compiles one `spec` (`gla_core.cost.compile_stage`).
COMPILE_WORKER = "gla_core.cost"
FIT_BATCH = FIT_HEADS = 1
_ESTIMATE = re.compile(r'hlo_op_name:\s*"([^"]+)"\s*estimated_cycles:\s*(\d+)')


@dataclasses.dataclass(frozen=True)
class CycleFit:
    """cycles ≈ intercept + slope * T for one kernel on the fit grid (B = H = 1), from compiles at
    `points` [(T, cycles)]."""

    kernel: str
    intercept: float
    slope: float
    points: tuple[tuple[int, int], ...]

    def at(self, seq_len: int, programs: int = 1) -> float:
        """Cycles at length `seq_len` for `programs` = B * H (batch, head) pairs: the per-token
        cost scales with the grid steps, the intercept is paid once."""
        return self.intercept + self.slope * seq_len * programs


def parse_profiles(directory: pathlib.Path) -> dict[str, int]:
    """Estimated cycles per HLO op name ("name.N" suffixes dropped, repeats summed)."""
    cycles: dict[str, int] = {}
    for path in sorted(directory.glob("*static_llo_profile*")):
        for name, value in _ESTIMATE.findall(path.read_text()):
            base = re.sub(r"\.\d+$", "", name)
            cycles[base] = cycles.get(base, 0) + int(value)
    return cycles


def _compile_in_subprocess(spec: dict, directory: pathlib.Path) -> None:
    logs = directory / "tpu-logs"  # a crashing profiled compile logs gigabytes; they go with the directory
    logs.mkdir(exist_ok=True)
    env = dict(
        os.environ,
        ALLOW_MULTIPLE_LIBTPU_LOAD="1",
        TPU_LOG_DIR=str(logs),
        LIBTPU_INIT_ARGS=f"--xla_jf_dump_static_llo_profile_to={directory}",
    )
    command = [sys.executable, "-m", COMPILE_WORKER, json.dumps(spec)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"compile subprocess failed ({done.returncode}): {' | '.join(tail)}")


def kernel_cycles(spec: dict, kernels: Sequence[str], seq_lens: Sequence[int] = FIT_SEQ_LENS) -> list[CycleFit]:
    """Fits each named kernel's static cycles linearly in T from compiles at `seq_lens` with one
    batch row and one head.

    `spec` describes the forward or training step to compile (see `gla_core.cost.compile_stage`; its batch, heads
    and seq_len are replaced); `kernels` are the named scopes of the Pallas kernels to fit.
    """
    samples: dict[str, list[tuple[int, int]]] = {k: [] for k in kernels}
    for seq_len in seq_lens:
        with tempfile.TemporaryDirectory() as tmp:
            small = {**spec, "batch": FIT_BATCH, "heads": FIT_HEADS, "seq_len": seq_len}
            _compile_in_subprocess(small, pathlib.Path(tmp))
            cycles = parse_profiles(pathlib.Path(tmp))
        for kernel in kernels:
            if kernel in cycles:
                samples[kernel].append((seq_len, cycles[kernel]))
    fits = []
    for kernel, points in samples.items():
        if len(points) >= 2:
            slope, intercept = np.polyfit([t for t, _ in points], [c for _, c in points], 1)
            fits.append(CycleFit(kernel, float(intercept), float(slope), tuple(points)))
    return fits
