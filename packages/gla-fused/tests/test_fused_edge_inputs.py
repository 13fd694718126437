"""`fused_chunk` and `fused_g_gamma` on unusual inputs and under JAX transformations, in TPU
interpret mode, against the float64 oracle.

- hard resets: log decays of -inf (decay exactly 0) in g (first and last steps of chunks, of a
  multi-chunk grid iteration and of the sequence) and in g_gamma for a whole head (the lag-0
  terms must stay e^0 = 1), with h0/ht and chunk sizes 16 to 128; g = -1e30 and finite
  decays far past exp's range (|g| C > 88). Outputs, final states and every gradient match
  the oracle; the gradient of a -inf gate is exactly 0;
- causality: a NaN or Inf in q, k or v at step t changes no output before t (q: no output but
  o_t), leaves every output from t on non-finite, and reaches no other batch row or head
  (outputs, final states, gradients); every finite value matches the recurrence;
- empty inputs (B = 0, T = 0); float64 inputs declined with the reason `explain` shows;
- transformations: higher-order derivatives raise `HigherOrderDerivativeError`; `jax.vmap`
  (forward and `jax.grad`) matches the oracle per mapped element (a mapped g_gamma too).

The helpers `forward_and_vjp`, `with_values` and `vmapped_against_oracle` are the ones of
gla-simple's tests/test_chunk_edge_inputs.py (fixed-length only here).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
from gla_core import errors
from gla_core.errors import HigherOrderDerivativeError
from gla_ref import testing

pytestmark = pytest.mark.interpret

IMPLS = ("fused_chunk", "fused_g_gamma")
H0_HT = dict(initial_state=True, output_final_state=True)


def dispatched(impl: str, interpret: bool):
    """`fn(**kwargs)` through dispatch, forcing `impl` for simple_gla."""
    return lambda **kwargs: gla_core.dispatch("simple_gla", impl=impl, interpret=interpret, **kwargs)


RESETS = {
    # NT = 8 at chunk 16: two grid iterations of 4 chunks; -inf at the first step, the last step of
    # a chunk, the first step of a grid iteration (64), inside one, and the last step
    "fused_chunk g chunk 16 B=2": (
        "fused_chunk",
        dict(gates=("g",), batch=2, seq_len=128, chunk_size=16),
        "g",
        [(0, 0, 0), (0, 15, 1), (1, 64, 0), (1, 63, 1), (0, 100, 1), (1, 127, 0)],
    ),
    "fused_chunk g several resets in a chunk": (
        "fused_chunk",
        dict(gates=("g",), seq_len=100, chunk_size=64),
        "g",
        [(0, 3, 0), (0, 10, 0), (0, 11, 0), (0, 40, 0), (0, 41, 1), (0, 90, 1), (0, 95, 1), (0, 99, 1)],
    ),
    "fused_chunk g+g_gamma one g_gamma head chunk 64": (
        "fused_chunk",
        dict(gates=("g", "g_gamma"), seq_len=100, chunk_size=64),
        "g_gamma",
        [(1,)],
    ),
    "fused_g_gamma one head chunk 128": (
        "fused_g_gamma",
        dict(gates=("g_gamma",), batch=2, seq_len=150, chunk_size=128),
        "g_gamma",
        [(1,)],
    ),
    "fused_g_gamma one head chunk 16 bf16": (
        "fused_g_gamma",
        dict(gates=("g_gamma",), seq_len=40, chunk_size=16, dtype=jnp.bfloat16),
        "g_gamma",
        [(0,)],
    ),
}


def check_resets(fn, case: testing.Case, gate: str, indices):
    """fn against the oracle (outputs and every gradient), and the gradient of every reset gate
    (`gate` at `indices`) exactly 0."""
    outputs, grads, reference = testing.forward_and_vjp(fn, case)
    tolerance = testing.tolerance_for(case.dtype)
    for name, value in outputs.items():
        testing.assert_close(name, value, reference.outputs[name], tolerance.output, label=case.label)
    for name, value in grads.items():
        testing.assert_close(name, value, reference.grads[name], tolerance.grad, label=case.label)
    for index in indices:
        assert not np.any(grads["d" + gate][index]), f"d{gate}{index} = {grads['d' + gate][index]}, expected 0"


@pytest.mark.parametrize("name", RESETS)
def test_hard_resets_match_the_oracle(name, interpret):
    impl, options, gate, indices = RESETS[name]
    case = testing.make_case("simple_gla", key_dim=24, value_dim=40, **H0_HT, **options)
    case = testing.with_values(case, gate, indices, -np.inf)
    check_resets(dispatched(impl, interpret), case, gate, indices)


def test_fused_chunk_huge_and_strong_finite_decays_match_the_oracle(interpret):
    """g = -1e30 (floored like -inf) next to finite decays of -60 per step (|g| C = 7680 at chunk 128)."""
    case = testing.make_case("simple_gla", batch=2, seq_len=140, key_dim=16, value_dim=24, chunk_size=128, **H0_HT)
    case = testing.with_values(case, "g", [(0, slice(60, 90), 1), (1, slice(100, 140), 0)], -60.0)
    huge = [(0, 3, 0), (1, 127, 1), (1, 128, 0)]
    case = testing.with_values(case, "g", huge, -1e30)
    check_resets(dispatched("fused_chunk", interpret), case, "g", huge)


# --------------------------------------------------------------------------- causality

POISONED_STEP, POISONED_ROW, POISONED_HEAD = 37, 0, 1  # inside a chunk of 16 (32..47)
CAUSALITY = {
    "fused_chunk q=nan": ("fused_chunk", ("g",), "q", np.nan),
    "fused_chunk v=nan": ("fused_chunk", ("g",), "v", np.nan),
    "fused_g_gamma k=nan": ("fused_g_gamma", ("g_gamma",), "k", np.nan),
    "fused_g_gamma v=inf": ("fused_g_gamma", ("g_gamma",), "v", np.inf),
}


def unaffected(name: str, shape, tensor: str):
    """Bool mask of the elements a non-finite `tensor` at the poisoned (row, step, head) must not change:
    other rows and heads; for o also the earlier steps (and the later ones for q)."""
    mask = np.ones(shape, bool)
    row, head = POISONED_ROW, POISONED_HEAD
    if name in ("final_state", "dinitial_state"):
        mask[row, head] = False
    elif name == "dg_gamma":
        mask[head] = False
    elif name == "o":
        mask[row, POISONED_STEP : POISONED_STEP + 1 if tensor == "q" else None, head] = False
    else:
        mask[row, :, head] = False
    return mask


@pytest.mark.parametrize("name", CAUSALITY)
def test_a_non_finite_input_reaches_no_earlier_output_nor_other_rows_or_heads(name, interpret):
    impl, gates, tensor, value = CAUSALITY[name]
    case = testing.make_case(
        "simple_gla", batch=2, seq_len=50, key_dim=8, value_dim=8, gates=gates, chunk_size=16, **H0_HT
    )
    case = testing.with_values(case, tensor, [(POISONED_ROW, POISONED_STEP, POISONED_HEAD)], value)
    outputs, grads, reference = testing.forward_and_vjp(dispatched(impl, interpret), case)
    tolerance = testing.tolerance_for(case.dtype)
    for label, got, expected, tol in [
        *((n, outputs[n], reference.outputs[n], tolerance.output) for n in outputs),
        *((n, grads[n], reference.grads[n], tolerance.grad) for n in grads),
    ]:
        mask = unaffected(label, got.shape, tensor)
        testing.assert_close(f"{label} (unaffected part)", got[mask], expected[mask], tol, label=case.label)
        finite = ~mask & np.isfinite(got)  # NaN allowed there, a finite value the recurrence lacks is not
        assert np.isfinite(expected[finite]).all(), f"{label}: finite where the recurrence is not"
        testing.assert_close(f"{label} (finite affected part)", got[finite], expected[finite], tol, label=case.label)
    o = outputs["o"][POISONED_ROW, :, POISONED_HEAD]
    affected = ~unaffected("o", outputs["o"].shape, tensor)[POISONED_ROW, :, POISONED_HEAD]
    assert not np.isfinite(o[affected]).any(), f"finite outputs at steps {np.flatnonzero(np.isfinite(o) & affected)}"


# --------------------------------------------------------------------------- empty inputs, float64


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("batch, seq_len", [(0, 9), (2, 0)], ids=["B=0", "T=0"])
def test_empty_inputs(impl, batch, seq_len, interpret):
    """Empty o, final state = initial state (zeros without one), gradients of the right shape
    (d initial_state = the final-state cotangent, d g_gamma = 0)."""
    heads, key_dim, value_dim = 2, 8, 4
    rng = np.random.default_rng(0)
    q = jnp.zeros((batch, seq_len, heads, key_dim), jnp.float32)
    v = jnp.zeros((batch, seq_len, heads, value_dim), jnp.float32)
    g_gamma = jnp.full((heads,), -0.5)
    h0 = jnp.asarray(rng.standard_normal((batch, heads, key_dim, value_dim)), jnp.float32)
    dht = jnp.asarray(rng.standard_normal(h0.shape), jnp.float32)
    fn = dispatched(impl, interpret)

    def loss(q, v, g_gamma, h0):
        o, final = fn(q=q, k=q, v=v, g_gamma=g_gamma, initial_state=h0, output_final_state=True)
        return jnp.sum(o) + jnp.sum(final * dht), (o, final)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (_, (o, final)), (dq, dv, dg_gamma, dh0) = grad(q, v, g_gamma, h0)
    assert o.shape == v.shape and dq.shape == q.shape and dv.shape == v.shape
    assert dg_gamma.shape == g_gamma.shape and not bool(jnp.any(dg_gamma))
    testing.assert_close("final_state", final, h0, 0.0)
    testing.assert_close("d initial_state", dh0, dht, 0.0)
    o, final = fn(q=q, k=q, v=v, g_gamma=g_gamma, output_final_state=True)
    assert o.shape == v.shape and final.shape == h0.shape and not bool(jnp.any(final))


@pytest.mark.parametrize("impl", IMPLS)
def test_float64_inputs_are_declined_with_a_reason(impl, interpret):
    with jax.enable_x64(True):
        case = testing.make_case(
            "simple_gla", seq_len=20, key_dim=8, value_dim=8, gates=("g_gamma",), dtype=jnp.float64
        )
        kwargs = {**{n: x.astype(jnp.float64) for n, x in case.inputs.items()}, **case.options, "interpret": interpret}
        resolution = gla_core.explain("simple_gla", **kwargs)
        (candidate,) = [c for c in resolution.candidates if c.implementation.name == impl]
        assert not candidate.accepted and "float64" in candidate.reason
        with pytest.raises(errors.ImplementationDeclinedError, match="float64"):
            gla_core.dispatch("simple_gla", impl=impl, **kwargs)


# --------------------------------------------------------------------------- transformations


@pytest.mark.parametrize("impl", IMPLS)
def test_higher_order_derivatives_raise_a_clear_error(impl, interpret):
    case = testing.make_case("simple_gla", seq_len=20, key_dim=8, value_dim=8, gates=("g_gamma",), **H0_HT)
    fn = dispatched(impl, interpret)

    def loss(q):
        o, final_state = fn(**{**case.kwargs(), "q": q})
        return jnp.sum(o**2) + jnp.sum(final_state**2)

    with pytest.raises(HigherOrderDerivativeError, match=rf"simple_gla impl='{impl}'.*impl='xla'"):
        jax.grad(lambda q: jnp.sum(jax.grad(loss)(q) ** 2))(case.inputs["q"])


VMAPS = {
    # every input mapped (g_gamma too): folds into B
    "fused_chunk g+g_gamma chunk 16": ("fused_chunk", ("g", "g_gamma"), ()),
    # a shared g_gamma folds into B; the initial state is broadcast to every element
    "fused_g_gamma shared g_gamma and h0": ("fused_g_gamma", ("g_gamma",), ("g_gamma", "initial_state")),
    # a mapped g_gamma (per head, not per batch row) cannot fold: once per element
    "fused_g_gamma mapped g_gamma": ("fused_g_gamma", ("g_gamma",), ()),
}


@pytest.mark.parametrize("name", VMAPS)
def test_vmap_matches_the_oracle_per_element(name, interpret):
    impl, gates, shared = VMAPS[name]
    cases = [
        testing.make_case("simple_gla", seq_len=40, gates=gates, chunk_size=16, gate_scale=1 + seed, seed=seed, **H0_HT)
        for seed in range(2)
    ]
    cases = [dataclasses.replace(c, inputs={**c.inputs, **{n: cases[0].inputs[n] for n in shared}}) for c in cases]
    testing.vmapped_against_oracle(dispatched(impl, interpret), cases, set(shared))
