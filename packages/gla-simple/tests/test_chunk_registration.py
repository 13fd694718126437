"""How dispatch sees the `chunk` implementations: registration, backend policy, declines."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import gla_core
from gla_core.kit import INTERPRET_HINT

OPS = ("simple_gla", "gla")


def _arrays(op: str, dtype=jnp.float32):
    shape = (1, 100, 2, 48)
    arrays = [jax.ShapeDtypeStruct(shape, dtype) for _ in range(3)]
    gate = {"gk": jax.ShapeDtypeStruct(shape, dtype)} if op == "gla" else {"g": jax.ShapeDtypeStruct(shape[:3], dtype)}
    return arrays, gate


def _candidate(resolution, name: str):
    return next(c for c in resolution.candidates if c.implementation.name == name)


@pytest.mark.parametrize("op", OPS)
def test_chunk_is_registered_for_tpu(op):
    chunk = next(i for i in gla_core.implementations(op) if i.name == "chunk")
    assert chunk.priority == 100
    assert chunk.backends == frozenset({"tpu"})
    assert chunk.interpretable
    assert chunk.package == "gla-simple"


@pytest.mark.parametrize("op", OPS)
def test_cpu_declines_chunk_with_the_interpret_hint(op):
    arrays, gate = _arrays(op)
    with gla_core.use(backend="cpu", interpret=False):
        resolution = gla_core.explain(op, *arrays, **gate)
    assert resolution.winner.name == "xla"
    reason = _candidate(resolution, "chunk").reason
    assert reason is not None and INTERPRET_HINT in reason


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "settings", [dict(backend="cpu", interpret=True), dict(backend="tpu")], ids=["interpret", "tpu"]
)
def test_chunk_accepts_in_interpret_mode_and_on_tpu(op, settings):
    """`chunk` accepts; it wins unless an accepting implementation has a higher priority
    (gla-fused's fused simple_gla kernels)."""
    arrays, gate = _arrays(op)
    with gla_core.use(**settings):
        resolution = gla_core.explain(op, *arrays, **gate)
    assert _candidate(resolution, "chunk").accepted
    accepted = [c.implementation for c in resolution.candidates if c.accepted]
    assert resolution.winner == max(accepted, key=lambda impl: impl.priority)
    if op == "gla":
        assert resolution.winner.name == "chunk"


def test_chunk_declines_float64_with_a_reason():
    arrays, gate = _arrays("simple_gla", jnp.float64)
    with gla_core.use(backend="tpu"):
        resolution = gla_core.explain("simple_gla", *arrays, **gate)
    assert "float64" in _candidate(resolution, "chunk").reason
    assert resolution.winner.name != "chunk"
