"""The options of kda `chunk` (`gla_kda.chunk.OPTIONS`): checked per call, defaulted by the per-chip table
(`gla_core.tuning`), and the kernels at the v6e table's chunk of 128 against the float64 oracle.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
from gla_core.chunk.gates import KeyMaskTable
from gla_core.errors import InvalidArgumentError, UnknownArgumentError
from gla_core.kit import default_anchor_range
from gla_kda import chunk
from gla_kda.pallas.config import BlockSizes
from gla_ref.testing import check_against_oracle, make_case

IMPL = "chunk"
DEFAULTS = {
    "kernel_chunk": None,
    "anchor_range": None,
    "chunks_per_step": 8,
    "intra_chunks_per_step": 16,
    "grad_chunks_per_step": 2,
    "state_heads_per_step": 4,
    "state_grad_heads_per_step": 2,
    "grad_heads_per_step": 2,
}
# v6e's row (v7x borrows it; `gla tune kda --chip v6e -T 2048 -H 8`): chunks of 128, else the defaults.
V6E_ROW = {**DEFAULTS, "kernel_chunk": 128}
# v5e's own row (`gla tune kda --chip v5e`, 841fb09; intra_chunks_per_step kept at 16): 4 value heads per
# grid step of the state gradient. The kernels set their own scoped VMEM limit; `test_chunk_tpu_compile.py`
# compiles this row for v5e.
V5E_ROW = {**V6E_ROW, "state_grad_heads_per_step": 4}


def _kwargs() -> dict:
    return make_case("kda", seq_len=8, key_dim=8, value_dim=8).kwargs()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kernel_chunk": 96}, r"kernel_chunk: expected one of \(16, 32, 64, 128\), got 96"),
        ({"chunks_per_step": 0}, r"chunks_per_step: expected a positive int, got 0"),
        ({"grad_chunks_per_step": 2.0}, r"grad_chunks_per_step: expected a positive int, got 2\.0"),
        ({"state_heads_per_step": True}, r"state_heads_per_step: expected a positive int, got True"),
        ({"state_grad_heads_per_step": -1}, r"state_grad_heads_per_step: expected a positive int, got -1"),
        ({"grad_heads_per_step": 0}, r"grad_heads_per_step: expected a positive int, got 0"),
        ({"intra_chunks_per_step": "8"}, r"intra_chunks_per_step: expected a positive int, got '8'"),
        ({"anchor_range": -1}, r"anchor_range: expected None \(the default of the input dtype\) .* got -1"),
    ],
)
def test_a_bad_option_is_an_error_naming_it(options, message):
    with pytest.raises(InvalidArgumentError, match=message):
        gla_core.dispatch("kda", impl=IMPL, interpret=True, impl_options={IMPL: options}, **_kwargs())


def test_an_unknown_option_is_an_error_listing_the_options():
    with pytest.raises(
        UnknownArgumentError, match=r"no option 'sub_chunk'; its options: \['anchor_range', 'chunks_per_step'"
    ):
        gla_core.dispatch("kda", impl=IMPL, interpret=True, impl_options={IMPL: {"sub_chunk": 8}}, **_kwargs())


def _options(**impl_options) -> dict:
    """The chunk implementation's option values for a kda call (traced for the TPU backend)."""
    resolution = gla_core.explain("kda", impl_options={IMPL: impl_options} if impl_options else None, **_kwargs())
    assert resolution.winner.name == IMPL
    return dict(resolution.options.values)


def test_the_chip_tables_set_the_options_and_a_call_overrides_them():
    with gla_core.use(backend="tpu"):  # traced for no TPU chip: no table, the declared defaults
        assert _options() == DEFAULTS
    for chip, row, table in (("v6e", V6E_ROW, "v6e"), ("v7x", V6E_ROW, "v6e"), ("v5e", V5E_ROW, "v5e")):
        with gla_core.use(backend="tpu", chip=chip):
            assert _options() == row, chip
            assert f"kernel_chunk=128 ({table} table)" in str(gla_core.explain("kda", **_kwargs()))
    with gla_core.use(backend="tpu", chip="v6e"):
        assert _options(kernel_chunk=None, chunks_per_step=2) == {**V6E_ROW, "kernel_chunk": None, "chunks_per_step": 2}
    with gla_core.use(backend="tpu", chip="v6e", kda=(IMPL, {"grad_chunks_per_step": 1})):
        assert _options() == {**V6E_ROW, "grad_chunks_per_step": 1}


def _counts(options: dict) -> dict:
    """The per-step counts of a mapping of options (all but `kernel_chunk` and `anchor_range`)."""
    return {name: value for name, value in options.items() if name not in ("kernel_chunk", "anchor_range")}


def test_block_sizes_of_the_options():
    """The kernels' tiles: the kernel chunk (else the call's), its default sub-block, the counts."""
    with gla_core.use(backend="tpu", chip="v6e"):
        options = gla_core.explain("kda", **_kwargs()).options
    assert chunk.block_sizes_of(options, 32) == BlockSizes(chunk_size=128, sub_chunk=16, **_counts(V6E_ROW))
    with gla_core.use(backend="tpu"):
        options = gla_core.explain("kda", impl_options={IMPL: {"kernel_chunk": 16}}, **_kwargs()).options
    assert chunk.block_sizes_of(options, 64) == BlockSizes(chunk_size=16, sub_chunk=16)
    with gla_core.use(backend="tpu"):
        options = gla_core.explain("kda", **_kwargs()).options
    assert chunk.block_sizes_of(options, 32) == BlockSizes(chunk_size=32, sub_chunk=16)


# Cases at kernel chunk 128 (the call's chunk_size is 32: the option replaces it). T <= 256: two chunks.
CHUNK_128_CASES = {
    # The v6e row's counts (capped by T and H), odd K and V, h0/ht.
    "v6e_row_h0_ht_odd_dims": (
        dict(seq_len=256, key_dim=48, value_dim=40, initial_state=True, output_final_state=True),
        V6E_ROW,
    ),
    "v6e_row_bf16_h0_ht": (
        dict(seq_len=256, dtype=jnp.bfloat16, initial_state=True, output_final_state=True),
        V6E_ROW,
    ),
    # T not a multiple of 128; one chunk and one value head per grid step: the state kernels walk two
    # sequential steps (h0 enters at one end, the final-state cotangent at the other).
    "one_chunk_one_head_per_step_T200_batch2_h0_ht": (
        dict(batch=2, seq_len=200, use_gate_in_kernel=True, initial_state=True, output_final_state=True),
        dict(
            kernel_chunk=128,
            chunks_per_step=1,
            intra_chunks_per_step=1,
            grad_chunks_per_step=1,
            state_heads_per_step=1,
            state_grad_heads_per_step=1,
            grad_heads_per_step=1,
        ),
    ),
    # Packed sequences: a length-1, a length-0 and two that cross the chunk boundary, grouped value heads.
    "varlen_grouped_l2norm_h0_ht": (
        dict(
            seq_len=256,
            cu_seqlens=[0, 1, 1, 150, 256],
            num_heads=1,
            num_value_heads=2,
            use_qk_l2norm_in_kernel=True,
            initial_state=True,
            output_final_state=True,
        ),
        V6E_ROW,
    ),
    # No anchored products: the exact gated products in intra, and the exact loop over the diagonal
    # sub-blocks in intra_bwd, for every chunk (by default, float32 inputs take the anchored ones where
    # a step's decay exponents stay within 8, bfloat16 inputs within 30).
    "exact_products_h0_ht": (
        dict(seq_len=256, initial_state=True, output_final_state=True),
        {**V6E_ROW, "anchor_range": 0},
    ),
    "exact_products_bf16_h0_ht": (
        dict(seq_len=256, dtype=jnp.bfloat16, initial_state=True, output_final_state=True),
        {**V6E_ROW, "anchor_range": 0},
    ),
}


@pytest.mark.interpret
@pytest.mark.parametrize("name", list(CHUNK_128_CASES))
def test_kernel_chunk_128_matches_oracle(name, interpret, monkeypatch):
    shape, options = CHUNK_128_CASES[name]
    case = make_case("kda", chunk_size=32, **shape)
    blocks = []
    pipeline = chunk.chunk_pipeline

    def recorded_pipeline(config, *arrays):
        blocks.append(config.kernel.blocks)
        return pipeline(config, *arrays)

    monkeypatch.setattr(chunk, "chunk_pipeline", recorded_pipeline)
    fn = lambda **kwargs: gla_core.dispatch(
        "kda", impl=IMPL, interpret=interpret, impl_options={IMPL: options}, **kwargs
    )
    errors = check_against_oracle(fn, case)
    assert {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"} <= set(errors)
    expected = BlockSizes(chunk_size=128, sub_chunk=16, **_counts(options))
    assert blocks and set(blocks) == {expected}, blocks


# Per-step decays (drawn -U(low, high)) too strong for a chunk of 128 anchored at its middle row, within
# the anchor range for 16-step sub-blocks: every step of kda_intra takes gla-core's blocked products.
BLOCKED_DECAYS = {"float32": (0.3, 0.7), "bfloat16": (1.0, 3.0)}


def _largest_anchored_exponent(g: np.ndarray, block: int) -> float:
    """max |b_t - b_m(t)| over blocks of `block` steps of g [B, T, H, K] (m(t) the block's middle row)."""
    b, t, h, k = g.shape
    sums = np.cumsum(g.reshape(b, t // block, block, h, k), axis=2)
    middle = block // 2 - 1
    return float(np.max(np.abs(sums - sums[:, :, middle : middle + 1])))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decays_too_strong_for_the_chunk_anchor_take_the_blocked_products(dtype, interpret):
    case = make_case(
        "kda", seq_len=256, chunk_size=32, dtype=jnp.dtype(dtype), initial_state=True, output_final_state=True
    )
    low, high = BLOCKED_DECAYS[dtype]
    g = -np.random.default_rng(0).uniform(low, high, case.inputs["g"].shape).astype(np.float32)
    case = dataclasses.replace(case, inputs={**case.inputs, "g": jnp.asarray(g)}, label=case.label + " blocked decays")
    anchor_range = default_anchor_range(jnp.dtype(dtype))
    assert _largest_anchored_exponent(g, 128) > anchor_range >= _largest_anchored_exponent(g, KeyMaskTable.SUB_BLOCK)
    fn = lambda **kwargs: gla_core.dispatch(
        "kda", impl=IMPL, interpret=interpret, impl_options={IMPL: V6E_ROW}, **kwargs
    )
    errors = check_against_oracle(fn, case)
    assert {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"} <= set(errors)
