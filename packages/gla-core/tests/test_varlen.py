"""The packed-to-chunk layout of gla_core.varlen, checked against a plain Python construction."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_core.varlen import build_chunk_layout, even_step_chunks, from_chunks, num_padded_chunks, to_chunks


def python_layout(boundaries: list[int], chunk: int):
    """Per chunk: (sequence, first, last, length) for the non-padding chunks."""
    chunks = []
    for n, (start, end) in enumerate(itertools.pairwise(boundaries)):
        length = end - start
        count = -(-length // chunk)
        for j in range(count):
            chunks.append((n, int(j == 0), int(j == count - 1), min(chunk, length - j * chunk)))
    return chunks


@pytest.mark.parametrize(
    ("boundaries", "chunk", "step_chunks"),
    [
        ([0, 100], 64, 1),
        ([0, 1, 1, 65, 130, 131], 64, 1),
        ([0, 1, 1, 65, 130, 131], 16, 4),
        ([0, 0, 0, 7], 16, 1),
        ([0, 16, 32], 16, 1),
        ([0, 5, 9, 200], 128, 1),
        ([0, 5, 9, 200], 16, 8),
    ],
)
def test_layout_matches_python_construction(boundaries, chunk, step_chunks):
    total = boundaries[-1]
    layout = build_chunk_layout(jnp.array(boundaries, jnp.int32), total, chunk, step_chunks)
    expected = python_layout(boundaries, chunk)
    used = len(expected)
    assert layout.num_chunks == num_padded_chunks(total, len(boundaries) - 1, chunk, step_chunks) >= used
    got = list(
        zip(
            np.asarray(layout.chunk_sequence[:used]).tolist(),
            np.asarray(layout.chunk_first[:used]).tolist(),
            np.asarray(layout.chunk_last[:used]).tolist(),
            np.asarray(layout.chunk_length[:used]).tolist(),
            strict=True,
        )
    )
    assert got == expected
    assert not np.asarray(layout.chunk_length[used:]).any()
    assert not np.asarray(layout.chunk_first[used:]).any() and not np.asarray(layout.chunk_last[used:]).any()
    lengths = np.diff(boundaries)
    np.testing.assert_array_equal(layout.sequence_length, lengths)
    np.testing.assert_array_equal(layout.empty_sequence, lengths == 0)


@pytest.mark.parametrize(
    ("total", "sequences", "chunk"), [(8192, 4, 128), (8192, 4, 64), (150, 3, 16), (7, 3, 16), (3, 5, 4)]
)
def test_padded_chunks_is_the_worst_case_of_any_boundaries(total, sequences, chunk):
    """Never fewer chunks than any partition takes, and exactly as many as its worst one: N - 1
    sequences of one token and one of the rest (with fewer tokens, one token per sequence)."""
    rng = np.random.default_rng(0)
    bound = num_padded_chunks(total, sequences, chunk)
    for _ in range(200):
        cuts = np.sort(rng.integers(0, total + 1, sequences - 1))
        lengths = np.diff(np.concatenate([[0], cuts, [total]]))
        assert sum(-(-int(n) // chunk) for n in lengths) <= bound
    ones = min(sequences - 1, total)
    worst = ones + -(-(total - ones) // chunk)
    assert bound == max(1, worst)


@pytest.mark.parametrize(
    ("num_chunks", "step_chunks", "expected"),
    [(68, 8, 72), (64, 8, 64), (65, 8, 72), (66, 16, 70), (6, 8, 6), (7, 1, 7), (1, 4, 1), (17, 4, 20)],
)
def test_even_step_chunks(num_chunks, step_chunks, expected):
    """The fewest grid steps of at most `step_chunks`, each of the same size, with less than one
    padding chunk per step."""
    got = even_step_chunks(num_chunks, step_chunks)
    assert got == expected
    steps = -(-num_chunks // step_chunks)
    assert got % steps == 0 and got // steps <= step_chunks and got - num_chunks < steps


def test_round_trip_and_zero_padding():
    boundaries = [0, 3, 3, 40, 41]
    x = jnp.arange(41 * 2, dtype=jnp.float32).reshape(1, 41, 2) + 1
    layout = build_chunk_layout(jnp.array(boundaries), 41, 16)
    padded = to_chunks(x, layout)
    assert padded.shape == (1, layout.padded_len, 2)
    assert float(padded.sum()) == pytest.approx(float(x.sum()))
    np.testing.assert_array_equal(from_chunks(padded, layout), x)

    # every chunk holds tokens of one sequence, starting at its first slot
    slots = np.asarray(padded[0, :, 0]).reshape(layout.num_chunks, 16)
    assert slots[0, :3].tolist() == [1, 3, 5] and not slots[0, 3:].any()


def test_changing_only_boundaries_does_not_recompile():
    traces = []

    @jax.jit
    def layout_sum(cu):
        traces.append(1)
        layout = build_chunk_layout(cu, 50, 32)
        return layout.chunk_length.sum(), layout.chunk_sequence

    for boundaries in ([0, 10, 50], [0, 49, 50], [0, 0, 50]):
        total, _ = layout_sum(jnp.array(boundaries, jnp.int32))
        assert int(total) == 50
    assert len(traces) == 1


def test_round_trip_without_tokens():
    x = jnp.zeros((1, 0, 3), jnp.bfloat16)
    layout = build_chunk_layout(jnp.array([0, 0, 0], jnp.int32), 0, 16)
    padded = to_chunks(x, layout)
    assert padded.shape == (1, layout.padded_len, 3) and padded.dtype == x.dtype
    assert not np.asarray(padded, np.float32).any()
    assert from_chunks(padded, layout).shape == x.shape
