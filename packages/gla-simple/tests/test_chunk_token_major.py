"""The `chunk` implementations (gla and simple_gla) on the token-major kernels
(`gla_core.chunk.token_pipeline`), end to end through dispatch in TPU interpret mode, against the
float64 oracle.

A call of fixed length with T a multiple of the chunk, K and V multiples of 128 and (for 16-bit
inputs) an even number of heads takes these kernels instead of the head-major ones, whatever its
gate (gk per key; g, g_gamma or both per token and head). Every case here fits, and each test
checks the call did take them (forward and backward): outputs, final states and every gradient
with the default tolerance of the dtype; decays past the anchor range; hard resets (-inf gates)
with their gradients exactly 0; a NaN that reaches no earlier output, no other head and no other
batch row; `jax.vmap`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
from gla_core.chunk import token_bwd, token_pipeline
from gla_ref import testing

pytestmark = pytest.mark.interpret

TOKEN_MAJOR = dict(key_dim=128, value_dim=128, initial_state=True, output_final_state=True)


@pytest.fixture
def routed(monkeypatch):
    """Counts the calls that reach the token-major forward and backward (traced afresh: the caches
    of jitted functions are cleared first)."""
    jax.clear_caches()
    calls = {"forward": 0, "backward": 0}
    for stage in calls:
        original = getattr(token_pipeline, stage)

        def counted(*args, _original=original, _stage=stage, **kwargs):
            calls[_stage] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(token_pipeline, stage, counted)
    return calls


def dispatched(interpret: bool, op: str = "gla"):
    return lambda **kwargs: gla_core.dispatch(op, impl="chunk", interpret=interpret, **kwargs)


CASES = {
    "gla f32 B=2 chunk 32": dict(op="gla", batch=2, seq_len=128, chunk_size=32, seed=11),
    # decays down to -20 per step: in-chunk exponents far past the anchor range (exact products)
    "gla f32 fast decays chunk 64": dict(op="gla", seq_len=128, chunk_size=64, gate_scale=4.0, seed=12),
    "gla bf16 H=4 chunk 16": dict(op="gla", seq_len=64, num_heads=4, chunk_size=16, dtype=jnp.bfloat16, seed=13),
    "gla bf16 fast decays chunk 32": dict(
        op="gla", seq_len=96, chunk_size=32, dtype=jnp.bfloat16, gate_scale=3.0, seed=14
    ),
    "simple_gla g f32 B=2 chunk 32": dict(op="simple_gla", gates=("g",), batch=2, seq_len=96, chunk_size=32, seed=21),
    "simple_gla g_gamma f32 chunk 64": dict(op="simple_gla", gates=("g_gamma",), seq_len=128, chunk_size=64, seed=22),
    "simple_gla g+g_gamma f32 fast decays chunk 16": dict(
        op="simple_gla", gates=("g", "g_gamma"), seq_len=64, chunk_size=16, gate_scale=4.0, seed=23
    ),
    "simple_gla g bf16 H=4 chunk 32": dict(
        op="simple_gla", gates=("g",), seq_len=64, num_heads=4, chunk_size=32, dtype=jnp.bfloat16, seed=24
    ),
    "simple_gla no gate f32 chunk 16": dict(op="simple_gla", gates=(), seq_len=32, chunk_size=16, seed=25),
}


@pytest.mark.parametrize("name", CASES)
def test_token_major_matches_the_oracle(name, routed, interpret):
    options = dict(CASES[name])
    op = options.pop("op")
    case = testing.make_case(op, **TOKEN_MAJOR, **options)
    errors = testing.check_against_oracle(dispatched(interpret, op), case)
    gate_grads = {"d" + name for name in case.differentiable if name in ("g", "g_gamma", "gk")}
    assert set(errors) >= {"o", "final_state", "dq", "dk", "dv", "dinitial_state", *gate_grads}
    assert routed["forward"] >= 1 and routed["backward"] >= 1, routed


def test_token_major_step_sizes_are_options(routed, interpret, monkeypatch):
    """`step_chunks` and `training_step_chunks` set the chunks of all heads per grid step: here the
    forward without a VJP takes 1 chunk per head and step, the forward for the VJP and the backward 4
    (what the forward keeps is laid out per chunk, so the backward may walk other steps)."""
    case = testing.make_case("gla", seq_len=128, chunk_size=32, seed=27, **TOKEN_MAJOR)
    options = {"chunk": {"step_chunks": 2, "training_step_chunks": 8, "block_chunks": 4}}
    chunks_per_step = set()
    geometry = token_pipeline.geometry

    def recorded(config, step_chunks):
        geo = geometry(config, step_chunks)
        chunks_per_step.add(geo.chunks_per_step)
        return geo

    monkeypatch.setattr(token_pipeline, "geometry", recorded)

    def fn(**kwargs):
        return gla_core.dispatch("gla", impl="chunk", interpret=interpret, impl_options=options, **kwargs)

    errors = testing.check_against_oracle(fn, case)
    assert {"o", "dq", "dgk"} <= set(errors)
    assert routed["forward"] >= 1 and routed["backward"] >= 1, routed
    assert chunks_per_step == {1, 4}, chunks_per_step


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_chunk_128_splits_the_backward_heads(dtype, routed, interpret, monkeypatch):
    """The `kernel_chunk` option (v6e's table: 128 for gla) overrides the call's chunk_size, and at
    chunks of 128 the backward kernel takes its heads in two halves one after the other (all heads'
    [C, C] temporaries at once would not fit the VMEM budget): T = 256 is two chunks, H = 4 two halves
    of whole head pairs for bfloat16."""
    case = testing.make_case("gla", seq_len=256, num_heads=4, chunk_size=32, dtype=dtype, seed=28, **TOKEN_MAJOR)
    chunks, groups = set(), []
    geometry, head_groups = token_pipeline.geometry, token_bwd.head_groups

    def recorded_geometry(config, step_chunks):
        geo = geometry(config, step_chunks)
        chunks.add(geo.chunk)
        return geo

    def recorded_groups(geo, group):
        groups.append(head_groups(geo, group))
        return groups[-1]

    monkeypatch.setattr(token_pipeline, "geometry", recorded_geometry)
    monkeypatch.setattr(token_bwd, "head_groups", recorded_groups)

    def fn(**kwargs):
        options = {"chunk": {"kernel_chunk": 128}}
        return gla_core.dispatch("gla", impl="chunk", interpret=interpret, impl_options=options, **kwargs)

    errors = testing.check_against_oracle(fn, case)
    assert {"o", "final_state", "dq", "dk", "dv", "dgk", "dinitial_state"} <= set(errors)
    assert routed["forward"] >= 1 and routed["backward"] >= 1, routed
    assert chunks == {128} and set(groups) == {2}, (chunks, groups)


def test_bfloat16_g_gamma_gradient_takes_the_head_major_kernels(routed, interpret):
    """d g_gamma sums the gate gradient of every step, so from bfloat16 inputs it needs float32
    products, which the token-major backward cannot hold for all heads in VMEM: such a call takes
    the head-major kernels (forward and backward; a forward alone stays token-major), and matches
    the oracle."""
    case = testing.make_case(
        "simple_gla", gates=("g", "g_gamma"), seq_len=64, chunk_size=32, dtype=jnp.bfloat16, seed=26, **TOKEN_MAJOR
    )
    errors = testing.check_against_oracle(dispatched(interpret, "simple_gla"), case)
    assert {"dg", "dg_gamma"} <= set(errors)
    assert routed["backward"] == 0, routed


def test_token_major_hard_resets(routed, no_races, interpret):
    """-inf per-key gates (some keys and all keys, at chunk edges and inside): oracle values, and the
    gradient of every reset gate exactly 0; two batch rows on two simulated cores, without races."""
    case = testing.make_case("gla", batch=2, seq_len=64, chunk_size=16, seed=15, **TOKEN_MAJOR)
    resets = [(0, 0, 0, 3), (0, 15, 1, slice(None)), (1, 16, 0, 5), (1, 40, 1, slice(None)), (1, 63, 0, 7)]
    case = testing.with_values(case, "gk", resets, -np.inf)
    outputs, grads, reference = testing.forward_and_vjp(dispatched(interpret), case)
    tolerance = testing.tolerance_for(case.dtype)
    for name, value in outputs.items():
        testing.assert_close(name, value, reference.outputs[name], tolerance.output, label=case.label)
    for name, value in grads.items():
        testing.assert_close(name, value, reference.grads[name], tolerance.grad, label=case.label)
    for index in resets:
        assert not np.any(grads["dgk"][index]), f"dgk{index} = {grads['dgk'][index]}, expected 0"
    assert routed["forward"] >= 1 and routed["backward"] >= 1, routed


@pytest.mark.parametrize("tensor, value", [("k", np.nan), ("v", np.inf)])
def test_token_major_non_finite_input_stays_causal(tensor, value, routed, interpret):
    """A NaN/Inf at (row 0, step 37, head 1) changes no earlier output of its head and nothing of the
    other head or row; its own output from step 37 on is non-finite."""
    step, row, head = 37, 0, 1
    case = testing.make_case("gla", batch=2, seq_len=64, chunk_size=16, seed=16, **TOKEN_MAJOR)
    poisoned = testing.with_values(case, tensor, [(row, step, head)], value)
    fn = dispatched(interpret)
    o, final_state = (np.asarray(x) for x in fn(**poisoned.kwargs()))
    reference = testing.oracle(case)
    clean = np.ones(o.shape, bool)
    clean[row, step:, head] = False
    tolerance = testing.tolerance_for(case.dtype)
    testing.assert_close("o (unaffected part)", o[clean], np.asarray(reference.outputs["o"])[clean], tolerance.output)
    final_clean = np.ones(final_state.shape, bool)
    final_clean[row, head] = False
    testing.assert_close(
        "final_state (other rows and heads)",
        final_state[final_clean],
        np.asarray(reference.outputs["final_state"])[final_clean],
        tolerance.output,
    )
    assert not np.isfinite(o[row, step:, head]).any(), "finite outputs at or after the poisoned step"
    # bitwise: the earlier outputs of the poisoned head are those of the clean run
    clean_o = np.asarray(fn(**case.kwargs())[0])
    np.testing.assert_array_equal(o[row, :step, head], clean_o[row, :step, head])
    assert routed["forward"] >= 1, routed


def test_token_major_under_vmap(routed, interpret):
    cases = [testing.make_case("gla", seq_len=32, chunk_size=16, seed=seed, **TOKEN_MAJOR) for seed in (17, 18)]
    testing.vmapped_against_oracle(dispatched(interpret), cases, set())
    assert routed["forward"] >= 1 and routed["backward"] >= 1, routed
