"""Hypothesis fuzzing of kda (implementation `xla`) against the float64 oracle.

Random shapes (T, H, HV/H, K, V), chunk size, in-kernel options, h0/ht and `cu_seqlens`
partitions with empty and length-1 sequences. Every example compiles the forward and the
backward once, so the example count is small (about 6 s per example here).
"""

from __future__ import annotations

import jax
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gla_core
from gla_ref.testing import check_against_oracle, make_case, random_cu_seqlens


@st.composite
def kda_cases(draw):
    seq_len = draw(st.integers(1, 200))
    num_heads = draw(st.integers(1, 2))
    ratio = draw(st.sampled_from([1, 2, 4]))
    varlen = draw(st.booleans())
    use_gate_in_kernel = draw(st.booleans())
    options = dict(
        seq_len=seq_len,
        num_heads=num_heads,
        num_value_heads=num_heads * ratio,
        key_dim=draw(st.integers(4, 72)),
        value_dim=draw(st.integers(4, 72)),
        chunk_size=draw(st.sampled_from([16, 32, 64])),
        initial_state=draw(st.booleans()),
        output_final_state=draw(st.booleans()),
        use_qk_l2norm_in_kernel=draw(st.booleans()),
        use_beta_sigmoid_in_kernel=draw(st.booleans()),
        use_gate_in_kernel=use_gate_in_kernel,
        seed=draw(st.integers(0, 2**16)),
    )
    if use_gate_in_kernel:
        options["dt_bias"] = draw(st.booleans())
        options["lower_bound"] = draw(st.sampled_from([None, -5.0]))
    if varlen:
        rng = np.random.default_rng(options["seed"])
        options["cu_seqlens"] = random_cu_seqlens(seq_len, draw(st.integers(1, 4)), rng, allow_empty=True)
    return make_case("kda", **options)


def _jitted_xla(case):
    static = {name: value for name, value in case.options.items() if not isinstance(value, jax.Array)}
    run = jax.jit(lambda arrays: gla_core.dispatch("kda", impl="xla", **arrays, **static))
    return lambda **kwargs: run({name: value for name, value in kwargs.items() if name not in static})


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=kda_cases())
def test_xla_matches_oracle(case):
    check_against_oracle(_jitted_xla(case), case)
