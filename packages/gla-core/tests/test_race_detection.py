"""Race detection in TPU interpret mode: a racy kernel must be flagged, a correct one must not.

Races happen between grid iterations that run at the same time, which interpret mode simulates
only with two or more cores: on one core "parallel" iterations run one after another and a
kernel whose iterations all write one block looks correct.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_core import tpu

ITERATIONS, ROWS, LANES = 4, 8, 128

pytestmark = pytest.mark.interpret


def _copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0  # [ROWS, LANES]


def _own_block(i):
    return i, 0


def _shared_block(i):
    del i
    return 0, 0


def _run(out_block, interpret):
    x = jnp.arange(ITERATIONS * ROWS * LANES, dtype=jnp.float32).reshape(ITERATIONS * ROWS, LANES)
    call = pl.pallas_call(
        _copy_kernel,
        out_shape=jax.ShapeDtypeStruct((ITERATIONS * ROWS, LANES), jnp.float32),
        grid=(ITERATIONS,),
        in_specs=[pl.BlockSpec((ROWS, LANES), _own_block)],
        out_specs=pl.BlockSpec((ROWS, LANES), out_block),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
    )
    return jax.block_until_ready(call(x))


def test_parallel_iterations_writing_one_block_are_flagged():
    with tpu.detect_races() as report:
        _run(_shared_block, tpu.interpret_params(True))
    assert report.kernels_checked == 1
    assert report.races_found


def test_parallel_iterations_writing_their_own_blocks_are_not_flagged():
    with tpu.detect_races() as report:
        _run(_own_block, tpu.interpret_params(True))
    assert report.kernels_checked == 1
    assert not report.races_found


def test_one_simulated_core_cannot_see_the_race():
    """Why detect_races() simulates two cores: with one, the same racy kernel passes."""
    with tpu.detect_races() as report:
        _run(_shared_block, pltpu.InterpretParams(detect_races=True, num_cores_or_threads=1))
    assert report.kernels_checked == 1
    assert not report.races_found


def test_interpret_params_use_two_cores_only_while_detecting_races(monkeypatch):
    monkeypatch.delenv(tpu.DETECT_RACES_ENV, raising=False)
    assert tpu.interpret_params(False) is False
    assert tpu.interpret_params(True).num_cores_or_threads == 1
    with tpu.detect_races():
        params = tpu.interpret_params(True)
        assert params.detect_races and params.num_cores_or_threads >= 2
    monkeypatch.setenv(tpu.DETECT_RACES_ENV, "1")
    assert tpu.interpret_params(True).num_cores_or_threads >= 2
