"""The `fused_chunk` implementation without running kernels: the tokens-per-grid-step rule,
its registration and how dispatch sees it (accepts, declines with reasons)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import gla_core
from gla_core.errors import InvalidArgumentError
from gla_fused.fused_chunk import impl
from gla_fused.fused_chunk.pipeline import FusedConfig
from gla_fused.fused_chunk.steps import largest_divisor_at_most


@pytest.mark.parametrize(
    ("count", "bound", "expected"),
    [(8, 4, 4), (6, 4, 3), (2, 4, 2), (1, 4, 1), (7, 4, 1), (12, 8, 6), (9, 4, 3), (64, 4, 4), (5, 1, 1)],
)
def test_largest_divisor_at_most(count, bound, expected):
    assert largest_divisor_at_most(count, bound) == expected


@pytest.mark.parametrize(("count", "bound", "message"), [(0, 4, "count"), (4, 0, "bound"), (4, -1, "bound")])
def test_largest_divisor_rejects_non_positive_counts(count, bound, message):
    with pytest.raises(ValueError, match=message):
        largest_divisor_at_most(count, bound)


def _structs(batch=1, dtype=jnp.float32):
    shape = (batch, 100, 2, 48)
    return [jax.ShapeDtypeStruct(shape, dtype) for _ in range(3)], jax.ShapeDtypeStruct(shape[:3], dtype)


def _candidate(resolution, name: str):
    return next(c for c in resolution.candidates if c.implementation.name == name)


def test_fused_chunk_is_registered_for_tpu():
    (fused,) = [i for i in gla_core.implementations("simple_gla") if i.name == "fused_chunk"]
    assert (fused.priority, fused.backends, fused.package) == (110, frozenset({"tpu"}), "gla-fused")
    assert fused.interpretable and fused.fn.__wrapped__ is impl.run  # behind with_state_layout


def test_supports_takes_varlen_and_declines_float64_with_a_reason():
    assert impl.supports(gla_core.Call("simple_gla", batch=2, gates={"g"}, backend="tpu")) is None
    assert impl.supports(gla_core.Call("simple_gla", dtype="bfloat16", backend="tpu")) is None
    assert impl.supports(gla_core.Call("simple_gla", num_sequences=3, gates={"g"}, backend="tpu")) is None
    assert "float64" in impl.supports(gla_core.Call("simple_gla", dtype="float64", backend="tpu"))


def test_explain_on_tpu_picks_fused_chunk_for_g():
    arrays, g = _structs(batch=2)
    with gla_core.use(backend="tpu"):
        resolution = gla_core.explain("simple_gla", *arrays, g=g, output_final_state=True)
    assert resolution.winner.name == "fused_chunk"
    assert _candidate(resolution, "chunk").accepted


def test_explain_on_tpu_picks_fused_chunk_for_varlen():
    arrays, g = _structs()
    with gla_core.use(backend="tpu"):
        resolution = gla_core.explain("simple_gla", *arrays, g=g, cu_seqlens=jnp.array([0, 37, 100], jnp.int32))
    assert resolution.winner.name == "fused_chunk"
    assert _candidate(resolution, "chunk").accepted


def _pallas_grids(jaxpr) -> list[tuple[int, ...]]:
    """The grid of every `pallas_call` in `jaxpr` and its sub-jaxprs."""
    grids = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            grids.append(tuple(eqn.params["grid_mapping"].grid))
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                grids.extend(_pallas_grids(inner))
    return grids


@pytest.mark.parametrize(("block_tokens", "time_steps"), [(16, 8), (32, 4), (48, 4), (128, 1)])
def test_block_tokens_option_sets_the_forward_grid(block_tokens, time_steps):
    """T = 128 at kernel chunk 16 is 8 chunks: `block_tokens` (rounded down to a divisor of the
    chunks) reaches the forward kernel's grid (B, T / block_tokens)."""
    q = jnp.zeros((1, 128, 2, 32))
    g = jnp.zeros((1, 128, 2))

    def forward(q, k, v, g):
        options = {"fused_chunk": {"kernel_chunk": 16, "block_tokens": block_tokens}}
        o, _ = gla_core.dispatch("simple_gla", q, k, v, g=g, impl="fused_chunk", interpret=True, impl_options=options)
        return o

    (grid,) = _pallas_grids(jax.make_jaxpr(forward)(q, q, q, g).jaxpr)
    assert grid == (1, time_steps)


def test_training_grids_walk_all_heads_of_a_block_per_step():
    """The forward and the backward kernel each run one grid step per (batch row, block of tokens)."""
    q = jnp.zeros((2, 256, 4, 32))
    g = jnp.zeros((2, 256, 4))

    def loss(q, k, v, g):
        o, _ = gla_core.dispatch("simple_gla", q, k, v, g=g, impl="fused_chunk", interpret=True)
        return o.sum()

    grids = _pallas_grids(jax.make_jaxpr(jax.grad(loss))(q, q, q, g).jaxpr)
    assert grids == [(2, 2), (2, 2)]


def test_explain_shows_fused_chunk_options():
    (q, k, v), g = _structs()
    with gla_core.use(backend="tpu"):
        resolution = gla_core.explain("simple_gla", q, k, v, g=g, impl_options={"fused_chunk": {"block_tokens": 256}})
    assert resolution.winner.name == "fused_chunk"
    assert resolution.options.describe() == "block_tokens=256, kernel_chunk=128 (default)"


def test_v6e_table_sets_chunk_256():
    """Calls traced for v6e (and v5e, v7x, which borrow its rows) take chunk 256 and 512 tokens per
    grid step from the per-chip table; a per-call option still wins."""
    (q, k, v), g = _structs()
    for chip in ("v5e", "v6e", "v7x"):
        with gla_core.use(backend="tpu", chip=chip):
            options = gla_core.explain("simple_gla", q, k, v, g=g).options
        assert (options["kernel_chunk"], options["block_tokens"]) == (256, 512), chip
    with gla_core.use(backend="tpu", chip="v6e"):
        options = gla_core.explain(
            "simple_gla", q, k, v, g=g, impl_options={"fused_chunk": {"kernel_chunk": 64}}
        ).options
    assert options["kernel_chunk"] == 64


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kernel_chunk": 96}, r"kernel_chunk: expected one of \(16, 32, 64, 128, 256\), got 96"),
        ({"block_tokens": 0}, "block_tokens: expected a positive int, got 0"),
    ],
)
def test_bad_fused_chunk_options_are_rejected(options, message):
    (q, k, v), g = _structs()
    with gla_core.use(backend="tpu"), pytest.raises(InvalidArgumentError, match=message):
        gla_core.explain("simple_gla", q, k, v, g=g, impl_options={"fused_chunk": options})


@pytest.mark.parametrize(
    ("seq_len", "sequences", "chunk", "block_tokens", "steps"),
    [(8192, 4, 256, 512, 18), (8192, 4, 128, 512, 17), (150, 7, 16, 64, 4), (150, 7, 16, 48, 5), (44, 1, 32, 64, 1)],
)
def test_packed_layout_fills_whole_grid_steps(seq_len, sequences, chunk, block_tokens, steps):
    """A packed row's chunk layout is as long as the tokens the kernels walk, and splits into the
    fewest grid steps of at most `block_tokens` (its worst case rounded up, `even_step_chunks`)."""
    q = jnp.zeros((1, seq_len, 2, 32), jnp.float32)
    config = FusedConfig.create(
        q,
        q,
        scale=None,
        output_final_state=False,
        interpret=True,
        kernel_chunk=chunk,
        block_tokens=block_tokens,
        num_sequences=sequences,
    )
    cu_seqlens = jnp.linspace(0, seq_len, sequences + 1).astype(jnp.int32)
    layout = config.layout(cu_seqlens)
    assert layout.num_chunks * chunk == config.padded_len
    assert config.padded_len // config.block_tokens == steps and config.block_tokens <= block_tokens
