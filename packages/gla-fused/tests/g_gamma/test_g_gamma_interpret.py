"""`fused_g_gamma` in TPU interpret mode against the float64 oracle: outputs, final states and
every gradient (d g_gamma and d initial_state included), default tolerance of the input dtype.

Each case combines several situations: g_gamma = -10 at chunk 128 (|g| C = 1280, where a
product of unanchored exponentials overflows), ALiBi decays, T not a multiple of the chunk
(the last chunk's padding must not decay the final state), NT = 1, 2 and 4, K/V not
multiples of 128, V split into two kernel tiles (per-tile partial sums of dq, dk, d gamma),
with and without h0/ht, bf16.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

import gla_core
from gla_core.kit import BlockSizes
from gla_fused.g_gamma import fused_g_gamma_attention
from gla_ref.testing import check_against_oracle, make_case

pytestmark = pytest.mark.interpret


def dispatched(interpret: bool):
    """`fn(**case.kwargs())` through dispatch, forcing `fused_g_gamma`."""
    return lambda **kwargs: gla_core.dispatch("simple_gla", impl="fused_g_gamma", interpret=interpret, **kwargs)


def with_block_sizes(interpret: bool, block_sizes: BlockSizes):
    """`fn(**case.kwargs())` on the op directly, with explicit kernel tiles."""

    def fn(q, k, v, g_gamma, *, cu_seqlens, **options):
        assert cu_seqlens is None
        return fused_g_gamma_attention(q, k, v, g_gamma, interpret=interpret, block_sizes=block_sizes, **options)

    return fn


def g_gamma_case(**options):
    return make_case("simple_gla", gates=("g_gamma",), **options)


H0_HT = dict(initial_state=True, output_final_state=True)


def _fast_decay_case():
    """NT = 2, the last chunk 72 of 128 steps; every exponent a multiple of -10."""
    case = g_gamma_case(seq_len=200, key_dim=40, value_dim=72, chunk_size=128, **H0_HT)
    return dataclasses.replace(case, inputs={**case.inputs, "g_gamma": jnp.full((2,), -10.0, jnp.float32)})


CASES = {
    "g_gamma=-10 chunk 128 h0 ht": _fast_decay_case,
    # NT = 4, B = 2, the last chunk 2 of 16 steps
    "alibi chunk 16 B=2 h0 ht": lambda: g_gamma_case(
        batch=2, seq_len=50, key_dim=48, value_dim=24, chunk_size=16, seed=1, **H0_HT
    ),
    # NT = 1, one partial chunk, K padded to 256 lanes, no final state
    "alibi chunk 64 NT=1 h0": lambda: g_gamma_case(
        seq_len=37, num_heads=3, key_dim=130, value_dim=20, chunk_size=64, initial_state=True, seed=2
    ),
    "bf16 alibi chunk 32 h0 ht": lambda: g_gamma_case(
        batch=2, seq_len=90, chunk_size=32, dtype=jnp.bfloat16, seed=3, **H0_HT
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fused_g_gamma_matches_oracle(name, interpret):
    case = CASES[name]()
    errors = check_against_oracle(dispatched(interpret), case)
    assert set(errors) == {*case.output_names, *("d" + name for name in case.differentiable)}
    assert "dg_gamma" in errors


def test_two_value_tiles_without_h0_and_no_races(interpret, no_races):
    """V = 200 in two 128-lane tiles (dq, dk, d gamma summed over tiles), NT = 2, ht but no h0;
    with interpret-mode race detection on (two simulated cores)."""
    case = g_gamma_case(seq_len=100, key_dim=100, value_dim=200, chunk_size=64, output_final_state=True, seed=4)
    check_against_oracle(with_block_sizes(interpret, BlockSizes(block_v=128)), case)
