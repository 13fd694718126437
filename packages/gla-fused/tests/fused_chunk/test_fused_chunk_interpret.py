"""The `fused_chunk` implementation in TPU interpret mode against the float64 oracle.

Outputs, final states and every gradient (dq, dk, dv, dg, dg_gamma, dinitial_state) with
the default tolerance of the input dtype (`gla_ref.testing.TOLERANCES`: float32 1e-5 for
outputs, 1e-4 for gradients). Each case combines several situations: every gate kind (g,
g_gamma, g + g_gamma, none), h0/ht, a decay of -10 per step at chunk 128, T not a multiple
of the chunk, K/V not multiples of 128, one and several chunks per grid step and grid steps
per sequence, bf16 (head pairs), packed varlen sequences starting and ending inside grid steps.
The tokens per grid step change nothing but the grid.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
from gla_fused.fused_chunk.pipeline import FusedConfig
from gla_ref.testing import TOLERANCES, assert_close, check_against_oracle, cotangents, make_case, oracle

pytestmark = pytest.mark.interpret


def _with_inputs(case, **inputs):
    return dataclasses.replace(case, inputs={**case.inputs, **inputs})


def dispatched(interpret: bool, **options):
    """`fn(**case.kwargs())` through dispatch, forcing `fused_chunk` with per-call `options`
    (kernel_chunk, block_tokens)."""

    def fn(**kwargs):
        impl_options = {"fused_chunk": options}
        return gla_core.dispatch(
            "simple_gla", impl="fused_chunk", interpret=interpret, impl_options=impl_options, **kwargs
        )

    return fn


DISPATCH_CASES = {
    # |g| * C = 1280: only overflow-safe, cancellation-free exponents keep the small gate
    # gradient (a non-finite value is an infinite error). Two grid steps of one chunk of 128.
    "g_gamma=-10 chunk 128 NT=2 h0 ht": lambda: _with_inputs(
        make_case(
            "simple_gla",
            seq_len=256,
            key_dim=40,
            value_dim=72,
            gates=("g_gamma",),
            chunk_size=128,
            initial_state=True,
            output_final_state=True,
        ),
        g_gamma=jnp.full((2,), -10.0, jnp.float32),
    ),
    "no gate NT=1 T<C ht scale": lambda: make_case(
        "simple_gla",
        batch=2,
        seq_len=50,
        key_dim=64,
        value_dim=96,
        gates=(),
        chunk_size=64,
        output_final_state=True,
        scale=0.3,
        seed=1,
    ),
    "bf16 g chunk 32 h0 ht": lambda: make_case(
        "simple_gla",
        batch=2,
        seq_len=128,
        gates=("g",),
        chunk_size=32,
        dtype=jnp.bfloat16,
        initial_state=True,
        output_final_state=True,
        seed=5,
    ),
}


@pytest.mark.parametrize("name", list(DISPATCH_CASES))
def test_fused_chunk_matches_oracle(name, interpret):
    """The kernels' chunk is the case's chunk size, 64 tokens per grid step at most."""
    case = DISPATCH_CASES[name]()
    options = dict(kernel_chunk=case.options["chunk_size"], block_tokens=64)
    errors = check_against_oracle(dispatched(interpret, **options), case)
    assert set(errors) >= {"o", "dq", "dk", "dv"}


def test_padded_time_several_chunks_per_step_and_wide_tiles_match_oracle(interpret, no_races):
    """T = 90 at kernel chunk 16 pads to 96 = 6 chunks; at most 64 tokens per grid step gives 3
    chunks (48 tokens) per step, 2 steps. K = 160 and V = 150 are not multiples of 128 lanes. The
    batch rows run on two simulated cores with race detection."""
    case = make_case(
        "simple_gla",
        batch=2,
        seq_len=90,
        key_dim=160,
        value_dim=150,
        gates=("g",),
        chunk_size=16,
        initial_state=True,
        output_final_state=True,
        seed=2,
    )
    q, v = case.inputs["q"], case.inputs["v"]
    config = FusedConfig.create(
        q, v, scale=None, output_final_state=True, interpret=True, kernel_chunk=16, block_tokens=64
    )
    assert (config.block_tokens, config.padded_len) == (48, 96)
    errors = check_against_oracle(dispatched(interpret, kernel_chunk=16, block_tokens=64), case)
    assert set(errors) == {"o", "final_state", "dq", "dk", "dv", "dg", "dinitial_state"}


def test_chunk_256_matches_oracle(interpret):
    """The v6e default kernel chunk (256, one chunk per grid step, all of T = 256) with g and a
    g_gamma of -10 per step (|a| * C = 2560 and more), h0 and ht: the [256, 256] decay matrices stay
    overflow-safe and every output and gradient matches the oracle."""
    case = make_case(
        "simple_gla",
        seq_len=256,
        key_dim=32,
        value_dim=48,
        gates=("g", "g_gamma"),
        chunk_size=64,
        initial_state=True,
        output_final_state=True,
        seed=6,
    )
    case = _with_inputs(case, g_gamma=jnp.full((2,), -10.0, jnp.float32))
    errors = check_against_oracle(dispatched(interpret, kernel_chunk=256, block_tokens=256), case)
    assert set(errors) == {"o", "final_state", "dq", "dk", "dv", "dg", "dg_gamma", "dinitial_state"}


def _outputs_and_grads(fn, case) -> dict[str, np.ndarray]:
    """fn's outputs and VJP with the oracle's cotangents, keyed like `gla_ref.testing.oracle`."""
    names = case.differentiable
    q, v = case.inputs["q"], case.inputs["v"]
    shapes = {"o": v.shape, "final_state": (q.shape[0], q.shape[2], q.shape[3], v.shape[3])}
    cts = cotangents(case, shapes, seed=0)

    @jax.jit
    def run(values):
        def forward(*values):
            return fn(**dict(zip(names, values, strict=True)), **case.options)

        outputs, vjp = jax.vjp(forward, *values)
        o, final_state = outputs
        return outputs, vjp((jnp.asarray(cts["o"], o.dtype), jnp.asarray(cts["final_state"], final_state.dtype)))

    (o, final_state), grads = run(tuple(case.inputs[n] for n in names))
    result = {"o": o, "final_state": final_state, **{"d" + n: x for n, x in zip(names, grads, strict=True)}}
    return {name: np.asarray(x) for name, x in result.items()}


def test_tokens_per_grid_step_change_nothing(interpret):
    """g + g_gamma, T = 128 at kernel chunk 16 (8 chunks): 8, 4, 2 and 1 chunks per grid step match
    the oracle and each other within the float32 rearrangement bound (each chunk is computed the
    same way whatever the grid; the bound leaves room for a compiler's reassociation)."""
    case = make_case(
        "simple_gla",
        seq_len=128,
        key_dim=48,
        value_dim=40,
        gates=("g", "g_gamma"),
        chunk_size=16,
        initial_state=True,
        output_final_state=True,
        seed=3,
    )
    results = {
        steps: _outputs_and_grads(dispatched(interpret, kernel_chunk=16, block_tokens=16 * steps), case)
        for steps in (8, 4, 2, 1)
    }
    reference = oracle(case)
    expected = {**reference.outputs, **reference.grads}
    assert set(results[8]) == set(expected)
    tol, rearranged = TOLERANCES["float32"], TOLERANCES["float32_rearranged"]
    for name, ref in expected.items():
        assert_close(name, results[8][name], ref, tol.output if name in reference.outputs else tol.grad)
        for steps in (4, 2, 1):
            assert_close(f"{name}, {steps} chunks per step", results[steps][name], results[8][name], rearranged.output)


# T = 150, N = 7, C = 16: 16 padded chunks, 4 grid steps of 4 chunks (64 tokens). Sequences (chunks):
# empty, 1 token (0), 29 (1-2), 20 (3-4, across a step edge), empty, 100 (5-11, across two edges and
# ending inside a step), empty at the end; chunks 12-15 are padding.
VARLEN_CU_SEQLENS = [0, 0, 1, 30, 50, 50, 150, 150]


@pytest.mark.parametrize(
    "dtype, gates", [(jnp.float32, ("g", "g_gamma")), (jnp.bfloat16, ("g",))], ids=["float32 g+g_gamma", "bf16 g"]
)
def test_packed_sequences_match_oracle(dtype, gates, interpret, no_races):
    """Packed varlen: every sequence restarts from its own initial state and emits its own final state
    at chunks inside grid steps (by DMA); empty sequences pass h0 through to ht and dht to dh0; every
    output and gradient matches the oracle (two simulated cores, race detection on)."""
    case = make_case(
        "simple_gla",
        seq_len=VARLEN_CU_SEQLENS[-1],
        num_heads=4 if dtype == jnp.bfloat16 else 2,
        key_dim=40,
        value_dim=48,
        gates=gates,
        chunk_size=16,
        cu_seqlens=VARLEN_CU_SEQLENS,
        dtype=dtype,
        initial_state=True,
        output_final_state=True,
        seed=7,
    )
    q, v = case.inputs["q"], case.inputs["v"]
    config = FusedConfig.create(
        q,
        v,
        scale=None,
        output_final_state=True,
        interpret=True,
        kernel_chunk=16,
        block_tokens=64,
        num_sequences=len(VARLEN_CU_SEQLENS) - 1,
    )
    assert (config.block_tokens, config.padded_len) == (64, 256)
    errors = check_against_oracle(dispatched(interpret, kernel_chunk=16, block_tokens=64), case)
    expected = {"o", "final_state", "dq", "dk", "dv", "dinitial_state"} | {"d" + gate for gate in gates}
    assert set(errors) == expected


def test_packed_padding_steps_carry_nothing_from_a_non_finite_token(interpret):
    """The padding steps of packed sequences hold other tokens of the row (token 0 here: the
    gather is not zeroed in XLA); the kernels zero them with `jnp.where`. With q, k, v of token 0 (the
    one-token sequence) NaN, every other sequence's outputs, final state and gradients stay finite."""
    case = make_case(
        "simple_gla",
        seq_len=VARLEN_CU_SEQLENS[-1],
        key_dim=40,
        value_dim=48,
        gates=("g",),
        chunk_size=16,
        cu_seqlens=VARLEN_CU_SEQLENS,
        initial_state=True,
        output_final_state=True,
        seed=8,
    )
    poisoned = {n: case.inputs[n].at[:, 0].set(jnp.nan) for n in ("q", "k", "v")}
    arrays = {**case.inputs, **poisoned}
    fn = dispatched(interpret, kernel_chunk=16, block_tokens=64)
    cu_seqlens = jnp.asarray(VARLEN_CU_SEQLENS, jnp.int32)

    def loss(q, k, v, g, initial_state):
        o, final_state = fn(
            q=q, k=k, v=v, g=g, initial_state=initial_state, output_final_state=True, cu_seqlens=cu_seqlens
        )
        return jnp.sum(o[:, 1:]) + jnp.sum(final_state[2:]), (o, final_state)

    names = ("q", "k", "v", "g", "initial_state")
    grads, (o, final_state) = jax.grad(loss, argnums=tuple(range(5)), has_aux=True)(*(arrays[n] for n in names))
    assert np.all(np.isnan(np.asarray(o[:, 0])))  # the poisoned sequence itself
    assert np.all(np.isfinite(np.asarray(o[:, 1:]))) and np.all(np.isfinite(np.asarray(final_state[2:])))
    for name, grad in zip(names, grads, strict=True):
        others = grad[2:] if name == "initial_state" else grad[:, 1:]
        assert np.all(np.isfinite(np.asarray(others))), name
