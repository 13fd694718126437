"""Fixtures for gla-kda tests: implementations run under one `jax.jit` per case, and cases with
edited inputs (hard resets, non-finite values) checked against the float64 oracle."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_ref.testing import Case, assert_close, cotangents, jit_dispatch, make_case, oracle, tolerance_for


@pytest.fixture
def jitted():
    """`jitted(impl, case) -> fn` for `gla_ref.testing.check_against_oracle(fn, case)`."""
    return jit_dispatch


def edit_inputs(case: Case, edits, label: str) -> Case:
    """`case` with single entries of its inputs overwritten.

    edits: (input name, index tuple, value) triples, e.g. ("g", (0, 31, 1, slice(0, 5)), -np.inf).
    """
    inputs = {name: np.array(x) for name, x in case.inputs.items()}
    for name, index, value in edits:
        inputs[name][index] = value
    arrays = {name: jnp.asarray(x, case.inputs[name].dtype) for name, x in inputs.items()}
    return dataclasses.replace(case, inputs=arrays, label=f"{case.label} {label}")


def _outputs_and_vjp(fn, case: Case, shapes):
    """fn's (o, final_state) and its VJP with the oracle's seeded cotangents, as float64 numpy dicts."""
    names = case.differentiable
    constant = {n: x for n, x in case.inputs.items() if n not in names}
    cts = cotangents(case, shapes, 0)

    @jax.jit
    def forward_and_vjp(values):
        outputs, vjp = jax.vjp(lambda *v: fn(**dict(zip(names, v, strict=True)), **constant, **case.options), *values)
        final_ct = None if outputs[1] is None else jnp.asarray(cts["final_state"], outputs[1].dtype)
        return outputs, vjp((jnp.asarray(cts["o"], outputs[0].dtype), final_ct))

    (o, final), grads = forward_and_vjp(tuple(case.inputs[n] for n in names))
    outputs = {"o": o} if final is None else {"o": o, "final_state": final}
    as64 = lambda x: np.asarray(x).astype(np.float64)
    return {n: as64(x) for n, x in outputs.items()}, {"d" + n: as64(g) for n, g in zip(names, grads, strict=True)}


def check_nonfinite_inputs(fn, case: Case, clean) -> None:
    """fn on a kda case with NaN/Inf inputs against the float64 oracle (the recurrence).

    - Outputs: non-finite exactly where the oracle's are (a NaN at step t reaches no output
      before t, no other sequence, batch row or head); equal to the oracle everywhere else.
    - Gradients: non-finite wherever the oracle's are (never a finite number in their place),
      and equal to the oracle on the `clean` slices, {gradient name: [index, ...]}: the
      sequences, batch rows and heads no non-finite input reaches.
    """
    reference = oracle(case)
    outputs, grads = _outputs_and_vjp(fn, case, {n: x.shape for n, x in reference.outputs.items()})
    tol = tolerance_for(case.dtype)
    for name, ref in reference.outputs.items():
        finite = np.isfinite(ref)
        wrong = np.argwhere(np.isfinite(outputs[name]) != finite)
        assert wrong.size == 0, (
            f"{case.label} {name}: finite/non-finite differs from the oracle at {wrong[:5].tolist()}"
        )
        assert_close(
            name, np.where(finite, outputs[name], 0.0), np.where(finite, ref, 0.0), tol.output, label=case.label
        )
    for name, ref in reference.grads.items():
        hidden = np.argwhere(np.isfinite(grads[name]) & ~np.isfinite(ref))
        assert hidden.size == 0, f"{case.label} {name}: finite where the oracle is not, at {hidden[:5].tolist()}"
        for index in clean.get(name, ()):
            assert np.isfinite(ref[index]).all(), f"{name}[{index}] is not clean in the oracle (test setup)"
            assert_close(f"{name}[{index}]", grads[name][index], ref[index], tol.grad, label=case.label)


@pytest.fixture
def nonfinite_check():
    """`nonfinite_check(fn, case, clean)`: see `check_nonfinite_inputs`."""
    return check_nonfinite_inputs


# --------------------------------------------------------------------------- special inputs
#
# Shared by the xla/recurrent tests and the chunk interpret tests, so every implementation
# sees the same hard resets and non-finite inputs. Positions are chosen around chunk (32),
# sub-chunk (16) and sequence boundaries.

_INF = np.inf


def _hard_reset_case(name: str) -> Case:
    """Gates of -inf (decay exactly 0), -1e30, -1e4 and runs of very strong finite decays."""
    if name == "grouped_h0_ht":
        case = make_case(
            "kda",
            batch=2,
            seq_len=100,
            num_heads=1,
            num_value_heads=2,
            key_dim=16,
            value_dim=16,
            chunk_size=32,
            initial_state=True,
            output_final_state=True,
        )
        edits = [
            ("g", (0, 0, 0, slice(None)), -_INF),  # first step: the initial state is dropped
            ("g", (0, 15, 1, slice(0, 5)), -_INF),  # last step of a sub-chunk, some keys
            ("g", (0, 16, 1, slice(3, 9)), -_INF),  # first step of the next sub-chunk
            ("g", (0, 31, 0, slice(0, 5)), -_INF),  # last step of a chunk
            ("g", (0, 32, 1, slice(None)), -_INF),  # first step of a chunk, whole head
            ("g", (0, 50, 0, 3), -_INF),  # one key mid sub-chunk
            ("g", (0, 99, slice(None), slice(None)), -_INF),  # last step: the final state is k v^T only
            ("g", (1, 40, slice(None), slice(None)), -1e30),
            ("g", (1, 47, 0, slice(0, 8)), -1e4),
            ("g", (1, slice(60, 70), 1, slice(None)), -300.0),  # a run of very strong finite decays
            ("g", (1, slice(80, 90), 0, slice(None)), -60.0),
        ]
    elif name == "varlen":
        case = make_case(
            "kda",
            seq_len=100,
            cu_seqlens=[0, 1, 1, 40, 100],
            key_dim=16,
            value_dim=16,
            chunk_size=16,
            initial_state=True,
            output_final_state=True,
        )
        edits = [
            ("g", (0, 0, 0, slice(None)), -_INF),  # the whole length-1 sequence
            ("g", (0, 1, slice(None), slice(None)), -_INF),  # first token of a sequence
            ("g", (0, 39, 1, slice(0, 8)), -_INF),  # last token of a sequence
            ("g", (0, 55, 0, slice(None)), -1e30),  # a chunk start inside the last sequence
            ("g", (0, 99, 1, slice(None)), -_INF),  # last token of all
        ]
    else:
        raise ValueError(f"name: unknown hard-reset case {name!r}")
    return edit_inputs(case, edits, f"hard resets ({name})")


def _gate_extremes_case(lower_bound) -> Case:
    """In-kernel gate with raw inputs up to +-1e30 and a large A_log: finite gates from 0 to -1e33."""
    case = make_case(
        "kda",
        seq_len=64,
        key_dim=16,
        value_dim=16,
        use_gate_in_kernel=True,
        lower_bound=lower_bound,
        use_qk_l2norm_in_kernel=True,
        initial_state=True,
        output_final_state=True,
    )
    edits = [
        ("g", (0, 3, 0, slice(None)), 1e30),
        ("g", (0, 4, 0, slice(None)), -1e30),
        ("g", (0, 20, 1, slice(0, 8)), 1e4),
        ("g", (0, 21, 1, slice(0, 8)), -1e4),
        ("g", (0, slice(40, 48), 0, slice(None)), 80.0),
        ("A_log", (1,), 6.0),
    ]
    return edit_inputs(case, edits, "gate extremes")


def _nonfinite_case(name: str):
    """(case, clean slices): NaN/Inf inputs, and where nothing non-finite can reach."""
    if name == "batch_heads_gate":
        # Batch row 0, head 0 only: batch row 1 and head 1 stay clean.
        case = make_case(
            "kda",
            batch=2,
            seq_len=100,
            key_dim=16,
            value_dim=16,
            chunk_size=32,
            use_gate_in_kernel=True,
            use_qk_l2norm_in_kernel=True,
            initial_state=True,
            output_final_state=True,
        )
        edits = [
            ("q", (0, 20, 0, 3), np.nan),  # reaches o[20] only
            ("v", (0, 33, 0, 5), _INF),  # reaches column 5 from step 33 on
            ("g", (0, 50, 0, 2), np.nan),  # raw gate input: every column from step 50 on
            ("k", (0, 70, 0, 0), np.nan),
            ("initial_state", (0, 0, 4, 9), _INF),  # column 9 from the first step on
        ]
        heads = [np.s_[1], np.s_[0, :, 1]]
        clean = {name: heads for name in ("dq", "dk", "dv", "dg", "dbeta")}
        clean.update(dinitial_state=[np.s_[1], np.s_[0, 1]], dA_log=[np.s_[1]], ddt_bias=[np.s_[16:]])
    elif name == "varlen_grouped":
        # Sequences 0 and 2 get non-finite inputs; sequences 1 (empty) and 3 stay clean.
        case = make_case(
            "kda",
            seq_len=100,
            cu_seqlens=[0, 30, 30, 64, 100],
            num_heads=1,
            num_value_heads=2,
            key_dim=16,
            value_dim=16,
            chunk_size=16,
            initial_state=True,
            output_final_state=True,
        )
        edits = [
            ("initial_state", (0, 1, 2, 1), np.nan),  # column 1 of value head 1 of sequence 0
            ("beta", (0, 40, 1), np.nan),
            ("g", (0, 50, 0, 2), np.nan),
            ("g", (0, 45, 1, 0), _INF),
        ]
        last = np.s_[0, 64:100]
        clean = {name: [last] for name in ("dq", "dk")}
        clean.update({name: [last, np.s_[0, 0:30, 0]] for name in ("dv", "dg", "dbeta")})
        clean.update(dinitial_state=[np.s_[1], np.s_[3], np.s_[0, 0]])
    elif name == "varlen_mid_sequence_h0":
        # Only the initial state of sequence 1, which starts inside a chunk run (a grid step), is
        # non-finite: sequences 0 and 2 around it stay clean, and nothing else is poisoned.
        case = make_case(
            "kda",
            seq_len=100,
            cu_seqlens=[0, 30, 64, 100],
            num_heads=2,
            key_dim=16,
            value_dim=16,
            chunk_size=16,
            initial_state=True,
            output_final_state=True,
        )
        edits = [("initial_state", (1, 0, 3, 7), np.nan), ("initial_state", (1, 1, 5, 2), -_INF)]
        outside = [np.s_[0, 0:30], np.s_[0, 64:100]]
        clean = {name: outside for name in ("dq", "dk", "dv", "dg", "dbeta")}
        clean.update(dinitial_state=[np.s_[0], np.s_[2]])
    else:
        raise ValueError(f"name: unknown non-finite case {name!r}")
    return edit_inputs(case, edits, f"non-finite ({name})"), clean


@pytest.fixture
def hard_reset_case():
    """`hard_reset_case(name)`: "grouped_h0_ht" or "varlen"."""
    return _hard_reset_case


@pytest.fixture
def gate_extremes_case():
    """`gate_extremes_case(lower_bound)`: the in-kernel gate at extreme raw inputs."""
    return _gate_extremes_case


@pytest.fixture
def nonfinite_case():
    """`nonfinite_case(name) -> (case, clean)`: "batch_heads_gate", "varlen_grouped" or
    "varlen_mid_sequence_h0"."""
    return _nonfinite_case
