"""gla_core.cost_scaling: probe problems, scaling probe cycles to the full shape, predicting a full-shape compile."""

from __future__ import annotations

import pytest

from gla_core.cost_scaling import MEMORY_MARGIN, predict_compile, probe_candidates, probe_spec, scale_cycles, tokens
from gla_core.errors import InvalidArgumentError
from gla_core.static_profile import KernelProfile

SPEC = {"program": "attention", "op": "gla", "batch": 2, "seq_len": 4096, "heads": 16}


def test_probe_is_one_row_of_the_given_length():
    assert probe_spec(SPEC, 512) == {**SPEC, "batch": 1, "seq_len": 512}
    assert tokens(SPEC) == 8192 and tokens(probe_spec(SPEC, 512)) == 512


def test_probe_candidates_are_shorter_than_the_full_problem():
    assert probe_candidates(SPEC) == [128, 256, 512, 1024, 2048, 4096]
    assert probe_candidates({**SPEC, "batch": 1, "seq_len": 512}) == [128, 256]


def test_scaling_through_two_probes_removes_the_constant():
    # 100 cycles of constant + 7 per token
    points = [(512, 100 + 7 * 512), (1024, 100 + 7 * 1024)]
    assert scale_cycles(points, 8192) == 100 + 7 * 8192


def test_scaling_needs_two_distinct_probes():
    with pytest.raises(InvalidArgumentError, match="different token counts"):
        scale_cycles([(512, 1), (512, 2)], 8192)
    with pytest.raises(InvalidArgumentError):
        scale_cycles([(512, 1000)], 8192)


def test_a_full_shape_compile_is_predicted_in_proportion_to_its_cycles():
    # 1 GB before the compile, 2 GB at its peak, 10 s, at 100k cycles; the full shape has 8x the cycles.
    probe = KernelProfile(0, "chunk_bwd", 100_000, 4096, seconds=10.0, base_bytes=10**9, peak_bytes=2 * 10**9)
    peak, seconds = predict_compile(probe, 800_000)
    assert peak == round(10**9 + MEMORY_MARGIN * 8 * 10**9) and seconds == 80.0
