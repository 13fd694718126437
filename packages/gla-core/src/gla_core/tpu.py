"""TPU hardware constants and small helpers shared by every Pallas kernel family."""

from __future__ import annotations

import os

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

NUM_LANES = 128  # minor-most dimension of a vreg
NUM_SUBLANES = 8  # second-minor dimension of a 32-bit vreg
DETECT_RACES_ENV = "GLA_DETECT_RACES"


def interpret_params(interpret: bool):
    """The `interpret=` value for `pl.pallas_call`: TPU interpret mode when asked, else False.

    TPU interpret mode checks out-of-bounds blocks and dimension semantics; with
    `GLA_DETECT_RACES=1` it also looks for races between parallel grid iterations.
    """
    if not interpret:
        return False
    detect_races = os.environ.get(DETECT_RACES_ENV, "") in ("1", "true", "yes")
    return pltpu.InterpretParams(detect_races=detect_races)


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


def unsupported_dtype_reason(dtype: str) -> str | None:
    """Why a Pallas TPU implementation declines inputs of dtype name `dtype`, or None if it takes them."""
    if dtype == "float64":
        return (
            "float64 inputs: the Pallas TPU kernels compute in bfloat16/float32 "
            "(cast the inputs to float32, or use impl='xla' or impl='reference')"
        )
    return None
