"""Fixtures for gla-ref tests: float64 mode and a float64 forward + VJP runner."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_ref.testing import ORACLE_COMPILER_OPTIONS, Case


@pytest.fixture
def x64():
    """Runs the test with float64 enabled (scoped: restored afterwards)."""
    with jax.enable_x64(True):
        yield


def _outputs(op: str, result) -> tuple:
    return (result,) if op == "kda_gate" else tuple(result)


def run_float64(fn, case: Case, seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """`fn(**case.kwargs())` and its VJP in float64 (every input cast up), compiled as one program
    with the oracle's compiler options (fast compiles).

    Options (cu_seqlens included) are closed over as constants, so host-side varlen code works.
    Cotangents are seeded N(0, 1) per output. Returns `(outputs, grads)` as numpy float64 dicts:
    outputs named "o", "final_state" (when returned) or "gate"; grads "d" + input name.
    """
    names = case.differentiable
    values = tuple(jnp.asarray(np.asarray(case.inputs[n], np.float64)) for n in names)

    def forward(*arrays):
        return _outputs(case.op, fn(**dict(zip(names, arrays, strict=True)), **case.options))

    shapes = jax.eval_shape(forward, *values)
    rng = np.random.default_rng(seed)
    cotangents = tuple(None if s is None else jnp.asarray(rng.standard_normal(s.shape)) for s in shapes)

    def run(arrays, cts):
        out, vjp = jax.vjp(forward, *arrays)
        return out, vjp(cts)

    compiled = jax.jit(run).lower(values, cotangents).compile(ORACLE_COMPILER_OPTIONS)
    out, grads = compiled(values, cotangents)
    labels = ("gate",) if case.op == "kda_gate" else ("o", "final_state")
    outputs = {label: np.asarray(x) for label, x in zip(labels, out, strict=True) if x is not None}
    return outputs, {"d" + n: np.asarray(g) for n, g in zip(names, grads, strict=True)}


@pytest.fixture
def float64_vjp():
    """`run_float64(fn, case, seed=0) -> (outputs, grads)`; use together with the `x64` fixture."""
    return run_float64
