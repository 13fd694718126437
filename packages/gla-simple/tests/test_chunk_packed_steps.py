"""Packed sequences starting and ending inside a grid step of several chunks (TPU interpret mode).

The sequential chunk kernels (forward, recomputed states, state gradients, the fused per-key
backward) take `block_chunks` chunks per grid step for packed calls too, resetting and emitting the
per-sequence states by DMA at the chunks whose metadata marks a sequence edge (`gla_core.chunk.packed`).
Every case here has sequences that start and end inside a step, an empty sequence, one shorter
than a chunk, h0 and ht; outputs and all gradients (dq, dk, dv, the gate's, dh0 with a dht
cotangent) are compared with the float64 oracle. A scalar gate is taken chunk by chunk, or, when a
grid step's steps fill 128-lane rows, broadcast over the keys by the per-key step kernels.
"""

from __future__ import annotations

import pytest

import gla_core
from gla_core.chunk.common import block_sizes_of
from gla_core.chunk.pipeline import ChunkConfig
from gla_ref import testing

pytestmark = pytest.mark.interpret

IMPL = "chunk"
CHUNK = 16
# T = 100, N = 6, C = 16: 12 padded chunks, 3 grid steps of 4. Sequences (chunks): empty, 3 tokens (0),
# 27 (1-2), 20 (3-4, across a step edge), 50 (5-8, across one and ending inside a step), empty;
# chunks 9-11 are padding.
CU_SEQLENS = [0, 0, 3, 30, 50, 100, 100]
BLOCKS = {"block_chunks": 4}
# V = 150 in two V tiles of 128: the per-sequence state slices of several tiles, and for gk the split
# backward (the fused one needs all of V in one block).
TWO_V_TILES = {"block_chunks": 4, "block_v": 128}

# T = 160, N = 6, C = 16: 16 padded chunks, 2 grid steps of 8 (128 steps: the scalar gate in "broadcast"
# mode). Sequences (chunks): empty, 3 (0), 27 (1-2), 20 (3-4), 110 (5-11, across the step edge and
# ending inside a step), empty; chunks 12-15 are padding.
BROADCAST_CU_SEQLENS = [0, 0, 3, 30, 50, 160, 160]
BROADCAST_BLOCKS = {"block_chunks": 8}

CASES = {
    "g": (dict(op="simple_gla", gates=("g",), value_dim=48), BLOCKS),
    "g broadcast": (dict(op="simple_gla", gates=("g", "g_gamma"), value_dim=48), BROADCAST_BLOCKS),
    "g_gamma two V tiles": (dict(op="simple_gla", gates=("g_gamma",), value_dim=150), TWO_V_TILES),
    "gk fused backward": (dict(op="gla", value_dim=48), BLOCKS),
    "gk split backward": (dict(op="gla", value_dim=150), TWO_V_TILES),
}


def _cu_seqlens(name: str) -> list[int]:
    return BROADCAST_CU_SEQLENS if "broadcast" in name else CU_SEQLENS


def _case(name: str):
    arguments, _ = CASES[name]
    arguments = dict(arguments)
    op = arguments.pop("op")
    cu_seqlens = _cu_seqlens(name)
    return testing.make_case(
        op,
        seq_len=cu_seqlens[-1],
        key_dim=40,
        cu_seqlens=cu_seqlens,
        chunk_size=CHUNK,
        initial_state=True,
        output_final_state=True,
        seed=31,
        **arguments,
    )


def _chunk_fn(op: str, options: dict, interpret: bool):
    """`fn(**case.kwargs())` through dispatch with the `chunk` implementation and its `options`."""

    def fn(**kwargs):
        return gla_core.dispatch(op, impl=IMPL, interpret=interpret, impl_options={IMPL: options}, **kwargs)

    return fn


def _check(name: str, interpret: bool) -> dict[str, float]:
    case = _case(name)
    options = CASES[name][1]
    inputs = case.inputs
    config = ChunkConfig.create(
        inputs["q"],
        inputs["v"],
        chunk_size=CHUNK,
        output_final_state=True,
        num_sequences=len(_cu_seqlens(name)) - 1,
        block_sizes=block_sizes_of(options),
        **{n: inputs.get(n) for n in ("k", "g", "g_gamma", "gk", "initial_state")},
    )
    specs = config.sequential_specs()
    assert specs.packed and specs.chunks_per_step == options["block_chunks"], (
        "the case must take packed multi-chunk steps"
    )
    assert ("broadcast" in name) == (config.gate_mode == "broadcast")
    return testing.check_against_oracle(_chunk_fn(case.op, options, interpret), case)


@pytest.mark.parametrize("name", list(CASES))
def test_packed_steps_match_the_oracle(name, interpret):
    errors = _check(name, interpret)
    gate_grad = "dgk" if "gk" in name else ("dg_gamma" if name.startswith("g_gamma") else "dg")
    assert {"o", "final_state", "dq", "dk", "dv", gate_grad, "dinitial_state"} <= set(errors)


@pytest.mark.parametrize("name", ["g", "g broadcast", "gk fused backward"])
def test_packed_steps_have_no_races(name, no_races, interpret):
    """Two simulated cores: the grid points of the parallel axes write their own state slices."""
    _check(name, interpret)
