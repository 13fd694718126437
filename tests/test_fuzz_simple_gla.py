"""Hypothesis fuzzing of simple_gla and gla against the float64 oracle: the `xla` implementations,
and the Pallas `chunk` implementations in TPU interpret mode (fewer, smaller examples).

Random T (1-300, from random packed-sequence lengths with empty and length-1 sequences for
varlen), heads, K and V (8-160), chunk size, gate kind, initial and final states. Every example
compiles a new program, so the profile is small and derandomized (the same examples on every
run, about a minute here); raise `max_examples` locally to search further.
"""

from __future__ import annotations

import jax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gla_core
from gla_core.ops import CHUNK_SIZES
from gla_ref import testing

SIMPLE_GATES = [(), ("g",), ("g_gamma",), ("g", "g_gamma")]


@st.composite
def problems(draw, max_len: int = 300, max_dim: int = 160) -> testing.Case:
    op = draw(st.sampled_from(["simple_gla", "gla"]))
    options = dict(
        num_heads=draw(st.integers(1, 3)),
        key_dim=draw(st.integers(8, max_dim)),
        value_dim=draw(st.integers(8, max_dim)),
        chunk_size=draw(st.sampled_from(CHUNK_SIZES)),
        initial_state=draw(st.booleans()),
        output_final_state=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )
    if op == "simple_gla":
        options["gates"] = draw(st.sampled_from(SIMPLE_GATES))
    if draw(st.booleans()):
        length = st.one_of(st.just(0), st.just(1), st.integers(2, max_len // 2))
        lengths = draw(st.lists(length, min_size=1, max_size=6))
        if sum(lengths) == 0:
            lengths[-1] = 1
        boundaries = [0]
        for length in lengths:
            boundaries.append(min(boundaries[-1] + length, max_len))
        options.update(seq_len=boundaries[-1], cu_seqlens=boundaries)
    else:
        options.update(seq_len=draw(st.integers(1, max_len)), batch=draw(st.integers(1, 2)))
    return testing.make_case(op, **options)


def _jitted(case: testing.Case, impl: str, **extra):
    static = {name: value for name, value in case.options.items() if not isinstance(value, jax.Array)}

    @jax.jit
    def run(arrays):
        return gla_core.dispatch(case.op, impl=impl, **arrays, **static, **extra)

    return lambda **kwargs: run({name: value for name, value in kwargs.items() if name not in static})


@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_xla_matches_oracle(case):
    testing.check_against_oracle(_jitted(case, "xla"), case)


@pytest.mark.interpret
@settings(
    max_examples=2,
    deadline=None,
    derandomize=True,
    # `interpret` is a constant per host, so sharing it between examples is safe
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(problems(max_len=96, max_dim=48))
def test_pallas_chunk_in_interpret_mode_matches_oracle(interpret, case):
    testing.check_against_oracle(_jitted(case, "chunk", interpret=interpret), case)
