"""kda implementation `chunk` (Pallas TPU kernels in TPU interpret mode) against the float64 oracle.

Each case runs `dispatch("kda", impl="chunk", interpret=interpret)` (True off TPU) forward and backward and
compares o, the final state and every gradient (q, k, v, g or raw g with A_log and dt_bias,
beta, initial_state) with `gla_ref.testing.check_against_oracle`. Tolerances are
`gla_ref.testing.TOLERANCES` (float32: 1e-5 outputs and final state, 1e-4 gradients;
bfloat16: the looser bounds stated there with their reasons). Shapes stay small (T <= 256,
K, V <= 64, H <= 2) and each case combines several options to keep compilations few; K and V
are never multiples of 128, so the lane padding is always exercised.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
from gla_core.errors import HigherOrderDerivativeError
from gla_core.varlen import num_padded_chunks
from gla_kda.pallas import sequence_states
from gla_kda.pallas.config import BlockSizes
from gla_kda.pallas.state import heads_per_step
from gla_ref.testing import (
    TOLERANCES,
    assert_close,
    check_against_oracle,
    cotangents,
    make_case,
    oracle,
    relative_error,
)

pytestmark = pytest.mark.interpret

CASES = {
    "h0_ht_T100_odd_dims": dict(seq_len=100, key_dim=48, value_dim=40, initial_state=True, output_final_state=True),
    "batch2_h0_ht_chunk32": dict(batch=2, seq_len=80, chunk_size=32, initial_state=True, output_final_state=True),
    "grouped_x2_l2norm_chunk16": dict(
        seq_len=72,
        num_heads=1,
        num_value_heads=2,
        use_qk_l2norm_in_kernel=True,
        chunk_size=16,
        initial_state=True,
        output_final_state=True,
    ),
    "gate_dt_bias_beta_sigmoid": dict(
        seq_len=96, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, initial_state=True
    ),
    "gate_lower_bound_no_dt_bias_l2norm": dict(
        seq_len=64, use_gate_in_kernel=True, dt_bias=False, lower_bound=-5.0, use_qk_l2norm_in_kernel=True
    ),
    # |g| * chunk is far above 88 (per-step decays down to -150): exp(G) underflows inside a
    # chunk; nothing may overflow, and dh0 still matches.
    "extreme_decay_chunk128_h0_ht": dict(
        seq_len=128, chunk_size=128, gate_scale=30.0, initial_state=True, output_final_state=True
    ),
    "varlen_leading_trailing_empty_gate": dict(
        seq_len=90,
        cu_seqlens=[0, 0, 37, 90, 90],
        chunk_size=32,
        use_gate_in_kernel=True,
        use_qk_l2norm_in_kernel=True,
        initial_state=True,
        output_final_state=True,
    ),
    "bf16_h0_ht": dict(seq_len=128, dtype=jnp.bfloat16, initial_state=True, output_final_state=True),
    # The state kernels and the gradient kernel take several value heads per grid step
    # (`state_heads_per_step`, `state_grad_heads_per_step`, `grad_heads_per_step`;
    # `test_heads_per_step` checks the counts): H=6 -> 3 heads per step (two blocks of heads)
    # forward, 2 (three blocks) in the reverse and the gradient kernels, and 10 chunks of 16 -> 5
    # chunks per step, two sequential time steps (the final-state cotangent enters at one end, dh0
    # leaves at the other); 2 chunks per step, five time steps, in the gradient kernel.
    "state_3_heads_per_step_2_time_steps_batch2_h0_ht": dict(
        batch=2, seq_len=160, num_heads=6, chunk_size=16, initial_state=True, output_final_state=True
    ),
    # Packed sequences: 12 chunks of 16 (the worst case, two steps of 6; 11 hold tokens), so one
    # sequence ends and the next starts inside a grid step of the state kernels (their states move
    # by DMA); 4 heads per step forward, 2 in the reverse and the gradient kernels (which
    # `test_gradient_kernel_steps_hold_sequence_edges` runs at 6 chunks per step as well).
    "state_4_heads_per_step_varlen_h0_ht": dict(
        seq_len=150,
        num_heads=4,
        cu_seqlens=[0, 21, 21, 150],
        chunk_size=16,
        initial_state=True,
        output_final_state=True,
    ),
    # Value heads sharing q/k heads: one value head per step, over 2 time steps.
    "state_grouped_x2_one_head_per_step_2_time_steps_h0_ht": dict(
        seq_len=160, num_heads=2, num_value_heads=4, chunk_size=16, initial_state=True, output_final_state=True
    ),
}


def test_heads_per_step():
    """The value heads per step of the state, reverse state-gradient and gradient kernels in the
    cases above (default `state_heads_per_step`, `state_grad_heads_per_step`, `grad_heads_per_step`)."""
    blocks = BlockSizes()
    for most, counts in (
        (blocks.state_heads_per_step, [3, 4, 1]),
        (blocks.state_grad_heads_per_step, [2, 2, 1]),
        (blocks.grad_heads_per_step, [2, 2, 1]),
    ):
        assert [heads_per_step(6, 1, most), heads_per_step(4, 1, most), heads_per_step(4, 2, most)] == counts
    assert [heads_per_step(16, 1, 4), heads_per_step(7, 1, 4), heads_per_step(1, 1, 4)] == [4, 1, 1]


def test_packed_state_steps_hold_sequence_edges():
    """The packed case above has 12 chunks of 16, walked 6 per grid step: sequence 0 (chunks 0-1)
    ends and sequence 2 (chunks 2-10) starts inside the first step, and the second ends on a padding
    chunk."""
    blocks = BlockSizes.for_chunk(16)
    num_chunks = num_padded_chunks(150, 3, 16, blocks.chunks_per_step)
    assert (num_chunks, blocks.per_step(num_chunks)) == (12, 6)


def test_gradient_kernel_steps_hold_sequence_edges(chunk_runner):
    """The packed case above with 6 chunks per step of the gradient kernel (7 asked for: the largest
    divisor of 12 not above it), 2 value heads each: sequence 0 ends and sequence 2 starts inside its
    first grid step, so both heads' carried states restart from h0 mid-step
    (`SequenceStates.restart_finite`)."""
    case = make_case("kda", **CASES["state_4_heads_per_step_varlen_h0_ht"])
    check_against_oracle(chunk_runner(case, dict(grad_chunks_per_step=7)), case)


@pytest.mark.parametrize("resident", [True, False], ids=["resident", "by_dma"])
def test_packed_states_resident_or_by_dma(resident, chunk_runner, monkeypatch):
    """The packed case above keeps its 3 sequences' states in VMEM (`resident_states`: 3 x 4 heads x
    128 x 128 float32 after lane padding, under `RESIDENT_STATES_BYTES`); with no room for them they
    move by DMA. Both match the oracle."""
    if not resident:
        monkeypatch.setattr(sequence_states, "RESIDENT_STATES_BYTES", 0)
    assert sequence_states.resident_states(True, 3, 4, 128, 128) == resident
    assert not sequence_states.resident_states(False, 3, 4, 128, 128)
    case = make_case("kda", **CASES["state_4_heads_per_step_varlen_h0_ht"])
    check_against_oracle(chunk_runner(case), case)


def _report(case, errors) -> str:
    """One line with the measured relative errors (shown with `pytest -s`)."""
    return f"{case.label}: " + ", ".join(f"{name} {error:.1e}" for name, error in errors.items())


@pytest.mark.parametrize("name", list(CASES))
def test_chunk_matches_oracle(name, chunk_runner):
    case = make_case("kda", **CASES[name])
    errors = check_against_oracle(chunk_runner(case), case)
    print(_report(case, errors))
    assert set(errors) >= {"o", "dq", "dk", "dv", "dg", "dbeta"}


def test_varlen_grouped_new_boundaries_reuse_the_training_step(interpret):
    """Varlen with unaligned boundaries, a length-1 and a length-0 sequence, grouped value heads.

    One jitted forward + VJP step with traced `cu_seqlens` runs two boundary sets of the same N
    and T: it compiles once, and both results match the float64 oracle (same cotangents).
    """
    options = dict(seq_len=150, num_heads=1, num_value_heads=2, initial_state=True, output_final_state=True)
    cases = [
        make_case("kda", cu_seqlens=[0, 1, 1, 67, 150], **options),
        make_case("kda", cu_seqlens=[0, 64, 64, 149, 150], seed=1, **options),
    ]
    static = {n: v for n, v in cases[0].options.items() if n != "cu_seqlens"}

    @jax.jit
    def step(inputs, cu_seqlens, cts):
        run = lambda inputs: gla_core.dispatch(
            "kda", impl="chunk", interpret=interpret, cu_seqlens=cu_seqlens, **inputs, **static
        )
        outputs, vjp = jax.vjp(run, inputs)
        return outputs, vjp(cts)[0]

    tol = TOLERANCES["float32"]
    for case in cases:
        reference = oracle(case)
        shapes = {name: value.shape for name, value in reference.outputs.items()}
        cts = {name: jnp.asarray(ct, jnp.float32) for name, ct in cotangents(case, shapes, 0).items()}
        (o, ht), grads = step(case.inputs, case.options["cu_seqlens"], (cts["o"], cts["final_state"]))
        errors = {"o": (o, tol.output), "final_state": (ht, tol.output)}
        errors.update({"d" + name: (grads[name], tol.grad) for name in case.differentiable})
        for name, (value, bound) in errors.items():
            expected = reference.outputs[name] if name in reference.outputs else reference.grads[name]
            assert_close(f"{case.label} {name}", value, expected, bound)
        print(
            _report(
                case,
                {
                    name: relative_error(value, reference.outputs.get(name, reference.grads.get(name)))
                    for name, (value, _) in errors.items()
                },
            )
        )
    assert step._cache_size() == 1


def _strong_gate_case(seed: int):
    """l2norm and the softplus gate in the kernel, scale 1, q/k/v ~ U(0, 1), raw g ~ N(0, 1) and
    A_log = log U(1, 16): per-step decays down to about -50, sub-chunk cumsums down to -290."""
    case = make_case(
        "kda",
        seq_len=64,
        num_heads=1,
        key_dim=64,
        value_dim=64,
        scale=1.0,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        dt_bias=False,
        seed=seed,
    )
    rng = np.random.default_rng(seed)
    inputs = {name: jnp.asarray(rng.uniform(0.0, 1.0, case.inputs[name].shape), jnp.float32) for name in "qkv"}
    inputs["g"] = jnp.asarray(rng.standard_normal(case.inputs["g"].shape), jnp.float32)
    inputs["A_log"] = jnp.asarray(np.log(rng.uniform(1.0, 16.0, case.inputs["A_log"].shape)), jnp.float32)
    return dataclasses.replace(case, inputs={**case.inputs, **inputs}, label=case.label + " q/k/v~U(0,1) strong gate")


def test_strong_in_kernel_gate_gradients(chunk_runner):
    """dA_log sums dg * gate over every step and key: dg must carry no rounding of terms that
    cancel (the gradient with respect to the chunk cumsum, reverse-cumsummed, gave dA_log 1.5e-3
    here; xla 1.4e-7). Runs with x64 on (float32 inputs): the kernels' index maps stay int32."""
    case = _strong_gate_case(seed=0)
    with jax.enable_x64(True):
        errors = check_against_oracle(chunk_runner(case), case)
    print(_report(case, errors))


@pytest.mark.parametrize("name", ["grouped_h0_ht", "varlen"])
def test_hard_resets_match_oracle(chunk_runner, hard_reset_case, name):
    """Gates of -inf (decay exactly 0), -1e30, -1e4 and runs of -300 at chunk, sub-chunk and
    sequence boundaries: finite, and equal to the oracle (a -inf gate has gradient 0)."""
    case = hard_reset_case(name)
    print(_report(case, check_against_oracle(chunk_runner(case), case)))


def test_in_kernel_gate_extremes_match_oracle(chunk_runner, gate_extremes_case):
    """Raw gate inputs up to +-1e30 with a large A_log: gates down to -1e33 stay finite and exact."""
    case = gate_extremes_case(None)
    print(_report(case, check_against_oracle(chunk_runner(case), case)))


@pytest.mark.parametrize("name", ["batch_heads_gate", "varlen_grouped", "varlen_mid_sequence_h0"])
def test_nonfinite_inputs_reach_only_later_outputs(chunk_runner, nonfinite_case, nonfinite_check, name):
    """A NaN/Inf input at step t reaches only the outputs the recurrence lets it reach: none
    before t (the in-chunk matmuls would carry it to earlier rows), none in other sequences,
    batch rows or heads."""
    case, clean = nonfinite_case(name)
    nonfinite_check(chunk_runner(case), case, clean)


@pytest.mark.parametrize("name", ["batch_heads_gate", "varlen_grouped", "varlen_mid_sequence_h0"])
def test_nonfinite_inputs_poison_across_grid_steps(chunk_runner, nonfinite_case, nonfinite_check, name):
    """The same with one chunk and one value head per grid step: the state kernel carries the
    columns a non-finite input reached from grid step to grid step (`gla_kda.pallas.poison`)."""
    case, clean = nonfinite_case(name)
    one_per_step = dict(
        chunks_per_step=1,
        intra_chunks_per_step=1,
        grad_chunks_per_step=1,
        state_heads_per_step=1,
        state_grad_heads_per_step=1,
        grad_heads_per_step=1,
    )
    nonfinite_check(chunk_runner(case, one_per_step), case, clean)


@pytest.mark.parametrize(
    "shape",
    [dict(batch=0, seq_len=20), dict(batch=2, seq_len=0), dict(seq_len=0, cu_seqlens=[0, 0, 0])],
    ids=["B0", "T0", "varlen_all_empty"],
)
def test_empty_inputs(chunk_runner, shape):
    """No tokens: empty outputs, final state = initial state, gradients of the right shapes."""
    case = make_case(
        "kda",
        num_heads=1,
        num_value_heads=2,
        use_gate_in_kernel=True,
        initial_state=True,
        output_final_state=True,
        **shape,
    )
    check_against_oracle(chunk_runner(case), case)


def test_vmap_matches_each_elements_oracle(interpret):
    """`jax.vmap` over a leading axis of every input (varlen with shared boundaries, grouped value
    heads, in-kernel gate, h0/ht): the forward and VJP of each mapped element equal its own float64
    oracle. The kernels fold the mapped axis into their batch axis (`gla_core.pallas_transforms`)."""
    options = dict(
        seq_len=40,
        cu_seqlens=[0, 7, 7, 40],
        num_heads=1,
        num_value_heads=2,
        chunk_size=16,
        use_gate_in_kernel=True,
        initial_state=True,
        output_final_state=True,
    )
    cases = [make_case("kda", seed=seed, **options) for seed in (0, 1)]
    static = {n: v for n, v in cases[0].options.items() if n != "cu_seqlens"}
    cu_seqlens = cases[0].options["cu_seqlens"]
    references = [oracle(case) for case in cases]
    shapes = {name: value.shape for name, value in references[0].outputs.items()}

    def forward_and_vjp(inputs, cts):
        run = lambda inputs: gla_core.dispatch(
            "kda", impl="chunk", interpret=interpret, cu_seqlens=cu_seqlens, **inputs, **static
        )
        outputs, vjp = jax.vjp(run, inputs)
        return outputs, vjp(cts)[0]

    stack = lambda trees: jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)
    cts = [cotangents(case, shapes, 0) for case in cases]
    cts = stack([(jnp.asarray(ct["o"], jnp.float32), jnp.asarray(ct["final_state"], jnp.float32)) for ct in cts])
    (o, ht), grads = jax.jit(jax.vmap(forward_and_vjp))(stack([case.inputs for case in cases]), cts)
    tol = TOLERANCES["float32"]
    for index, (case, reference) in enumerate(zip(cases, references, strict=True)):
        assert_close("o", o[index], reference.outputs["o"], tol.output, label=case.label)
        assert_close("final_state", ht[index], reference.outputs["final_state"], tol.output, label=case.label)
        for name in case.differentiable:
            assert_close("d" + name, grads[name][index], reference.grads["d" + name], tol.grad, label=case.label)


def test_second_order_gradients_raise_a_clear_error(interpret):
    """The backward is hand-written kernels: differentiating it again names the implementation
    and the alternative instead of failing inside Pallas."""
    case = make_case("kda", seq_len=16, initial_state=True)
    static = dict(case.options)

    def loss(q):
        o, _ = gla_core.dispatch("kda", impl="chunk", interpret=interpret, **{**case.inputs, "q": q}, **static)
        return jnp.sum(o * o)

    with pytest.raises(HigherOrderDerivativeError, match=r"(?s)kda impl='chunk'.*impl='xla'"):
        jax.grad(lambda q: jnp.sum(jax.grad(loss)(q)))(case.inputs["q"])
