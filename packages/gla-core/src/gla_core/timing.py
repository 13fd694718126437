"""Wall-clock timing of one implementation on one problem, forward and forward + backward.

Used by `gla demo` and `gla bench`; absolute times on a shared machine are noisy, so callers
compare implementations measured side by side in one run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def _outputs(result: Any) -> tuple:
    return tuple(x for x in (result if isinstance(result, tuple) else (result,)) if x is not None)


def _median_seconds(step: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(step())  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def forward_seconds(fn: Callable[..., Any], inputs: dict, options: dict, repeats: int = 3) -> float:
    """Median time of jitted `fn(**inputs, **options)`; `inputs` are arrays, `options` static or arrays."""
    step = jax.jit(lambda arrays: fn(**arrays, **options))
    return _median_seconds(lambda: step(inputs), repeats)


def forward_backward_seconds(
    fn: Callable[..., Any], inputs: dict, options: dict, differentiable: tuple[str, ...], repeats: int = 3
) -> float:
    """Median time of jitted forward + gradient of `sum(output)` over every output wrt `differentiable`."""

    def loss(wrt: dict, constant: dict) -> jax.Array:
        outputs = _outputs(fn(**wrt, **constant, **options))
        return sum(jnp.sum(out.astype(jnp.float32)) for out in outputs)

    wrt = {name: inputs[name] for name in differentiable}
    constant = {name: x for name, x in inputs.items() if name not in wrt}
    step = jax.jit(jax.grad(loss))
    return _median_seconds(lambda: step(wrt, constant), repeats)
