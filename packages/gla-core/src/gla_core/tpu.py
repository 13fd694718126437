"""TPU hardware constants and small helpers shared by every Pallas kernel family."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax._src.pallas.mosaic.interpret import interpret_pallas_call
from jax.experimental.pallas import tpu as pltpu

NUM_LANES = 128  # minor-most dimension of a vreg
NUM_SUBLANES = 8  # second-minor dimension of a 32-bit vreg
# The scoped VMEM limit of a kernel that sets `vmem_limit_bytes`, and the most it may use: 3/4 of
# v7x's 64 MiB per core (v5e and v6e have 128 MiB), so every chip generation keeps room beside it.
KERNEL_VMEM_BUDGET_BYTES = 48 * 2**20
DETECT_RACES_ENV = "GLA_DETECT_RACES"
# Simulated TensorCores per device when looking for races: "parallel" grid iterations only
# overlap (and can race) when at least two cores run them. Two cores make interpret mode about
# 8x slower, so they are used only while races are looked for.
RACE_DETECTION_CORES = 2

_detecting_races: contextvars.ContextVar[bool] = contextvars.ContextVar("gla_detecting_races", default=False)


def races_detected_by_default() -> bool:
    """True inside `detect_races()` or when `GLA_DETECT_RACES=1`."""
    return _detecting_races.get() or os.environ.get(DETECT_RACES_ENV, "") in ("1", "true", "yes")


def interpret_params(interpret: bool):
    """The `interpret=` value for `pl.pallas_call`: TPU interpret mode when asked, else False.

    TPU interpret mode checks out-of-bounds blocks and dimension semantics. Inside
    `detect_races()` (or with `GLA_DETECT_RACES=1`) it simulates `RACE_DETECTION_CORES`
    cores and looks for races between grid iterations that run on different cores. Read when
    a kernel is traced: `detect_races()` clears JAX's caches so no earlier trace is reused.
    """
    if not interpret:
        return False
    if races_detected_by_default():
        return pltpu.InterpretParams(detect_races=True, num_cores_or_threads=RACE_DETECTION_CORES)
    return pltpu.InterpretParams()


@dataclasses.dataclass
class RaceReport:
    """What `detect_races()` saw: the number of kernel runs checked and how many had a race."""

    kernels_checked: int = 0
    kernels_with_races: int = 0

    @property
    def races_found(self) -> bool:
        return self.kernels_with_races > 0


@contextlib.contextmanager
def detect_races() -> Iterator[RaceReport]:
    """Runs the Pallas kernels interpreted inside the block on two simulated cores, looking for races.

    Yields a `RaceReport` that is complete when the block exits. JAX's caches are cleared on
    entry and exit, so kernels traced before (or inside) the block are retraced with the right
    interpret parameters. Not thread-safe: TPU interpret mode keeps global state.

    Example:
      >>> with gla_core.tpu.detect_races() as report:
      ...     jax.block_until_ready(dispatch("simple_gla", q, k, v, g=g, impl="chunk", interpret=True))
      >>> assert report.kernels_checked and not report.races_found
    """
    report = RaceReport()
    states = []
    original = interpret_pallas_call.RaceDetectionState

    class RecordingRaceDetectionState(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            states.append(self)

    token = _detecting_races.set(True)
    interpret_pallas_call.RaceDetectionState = RecordingRaceDetectionState
    jax.clear_caches()
    try:
        yield report
    finally:
        interpret_pallas_call.RaceDetectionState = original
        _detecting_races.reset(token)
        jax.clear_caches()
        report.kernels_checked = len(states)
        report.kernels_with_races = sum(state.races_found for state in states)


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= `value`."""
    return -(-value // multiple) * multiple


def pad_axis(x, axis: int, size: int):
    """Zero-pads `x` along `axis` to `size` (no copy when it already has that size)."""
    axis = axis % x.ndim
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    if extra < 0:
        raise ValueError(f"pad_axis: cannot pad axis {axis} of size {x.shape[axis]} down to {size}")
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def any_nonfinite(x, axis: int = -1, keepdims: bool = False):
    """Whether `x` holds a NaN or +-inf along `axis` (bool), for the XLA code around the kernels.

    A maximum of float32 flags rather than `jnp.any(~jnp.isfinite(x))`: on TPU, XLA reduces booleans
    over the minor axis through transposes. libtpu's v6e estimate for [1, 4096, 4, 128] bfloat16:
    134,241 cycles for `jnp.any`, 15,320 for this form; the same answer.
    """
    return jnp.max(jnp.where(jnp.isfinite(x), 0.0, 1.0), axis=axis, keepdims=keepdims) > 0


def unsupported_dtype_reason(dtype: str) -> str | None:
    """Why a Pallas TPU implementation declines inputs of dtype name `dtype`, or None if it takes them."""
    if dtype == "float64":
        return (
            "float64 inputs: the Pallas TPU kernels compute in bfloat16/float32 "
            "(cast the inputs to float32, or use impl='xla' or impl='reference')"
        )
    return None
