"""The `chunk` implementations (simple_gla and gla) on unusual inputs and under JAX transformations,
in TPU interpret mode, against the float64 oracle.

- hard resets: log decays of -inf (decay exactly 0) in g, g_gamma (a whole head) and gk (some
  keys), at the first and last step of chunks and of sequences, with h0/ht, varlen, bf16 and
  chunk sizes 16 to 128; gates of -1e30 and finite decays far past exp's range (|g| C > 88).
  Outputs, final states and every gradient match the oracle; the gradient of a -inf (or -1e30)
  gate is exactly 0;
- causality: a NaN or Inf in q, k or v at step t changes no output before t (q: no output but
  o_t), leaves every output from t to the end of its sequence non-finite (no silent number), and
  reaches no other batch row, head or packed sequence (outputs, final states and gradients).
  Gradients of the poisoned sequence may be NaN where the recurrence's are finite (at earlier
  steps of the poisoned chunk: triangular matmuls multiply the NaN by zeros), but every finite
  value matches the recurrence;
- empty inputs: B = 0, T = 0 and packed sequences that are all empty;
- float64 inputs: declined, with the reason `explain` shows;
- transformations: higher-order derivatives raise `HigherOrderDerivativeError`; `jax.vmap`
  (forward and `jax.grad`) matches the oracle per mapped element, also with unmapped
  arguments and packed sequences (shared or per-element cu_seqlens).
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

IMPL = "chunk"
H0_HT = dict(initial_state=True, output_final_state=True)


def dispatched(op: str, interpret: bool):
    """`fn(**kwargs)` through dispatch, forcing the `chunk` implementation."""
    return lambda **kwargs: gla_core.dispatch(op, impl=IMPL, interpret=interpret, **kwargs)


RESETS = {
    # -inf at the first step, the last and first step of chunks, and the last step of the sequence
    "g chunk 16 B=2": (
        dict(op="simple_gla", gates=("g",), batch=2, seq_len=50, chunk_size=16),
        {"g": [(0, 0, 0), (0, 15, 1), (0, 16, 0), (1, 31, 1), (1, 32, 0), (1, 49, 1)]},
    ),
    # head 0: the last step of a sequence, a one-step sequence, the first step of a sequence, inside a
    # chunk; head 1: g_gamma = -inf, every step decays to exactly 0 (the lag-0 terms must stay e^0 = 1)
    "g+g_gamma varlen chunk 32": (
        dict(op="simple_gla", gates=("g", "g_gamma"), seq_len=70, cu_seqlens=[0, 20, 21, 70], chunk_size=32),
        {"g": [(0, 19, 0), (0, 20, 0), (0, 21, 0), (0, 40, 0)], "g_gamma": [(1,)]},
    ),
    "gk some keys chunk 128 B=2": (
        dict(op="gla", batch=2, seq_len=150, chunk_size=128),
        {"gk": [(0, 0, 0, 3), (0, 127, 1, 0), (1, 128, 0, 5), (1, 149, 1, 7), (1, 60, 0, slice(None))]},
    ),
    "gk all keys varlen chunk 32": (
        dict(op="gla", seq_len=60, cu_seqlens=[0, 33, 33, 60], chunk_size=32),
        {"gk": [(0, 10, 0, slice(None)), (0, 32, 1, slice(None)), (0, 33, 1, slice(None)), (0, 59, 0, slice(None))]},
    ),
    "bf16 g chunk 64": (
        dict(op="simple_gla", gates=("g",), batch=2, seq_len=70, chunk_size=64, dtype=jnp.bfloat16),
        {"g": [(0, 63, 0), (1, 64, 1), (1, 5, 0)]},
    ),
}


def check_resets(fn, case: testing.Case, resets: dict):
    """fn against the oracle on `case` (outputs and every gradient, default tolerance), and the
    gradient of every reset gate (`{gate name: indices}`) exactly 0."""
    outputs, grads, reference = testing.forward_and_vjp(fn, case)
    tolerance = testing.tolerance_for(case.dtype)
    for name, value in outputs.items():
        testing.assert_close(name, value, reference.outputs[name], tolerance.output, label=case.label)
    for name, value in grads.items():
        testing.assert_close(name, value, reference.grads[name], tolerance.grad, label=case.label)
    for gate, indices in resets.items():
        for index in indices:
            assert not np.any(grads["d" + gate][index]), f"d{gate}{index} = {grads['d' + gate][index]}, expected 0"


@pytest.mark.parametrize("name", RESETS)
def test_hard_resets_match_the_oracle(name, interpret):
    options, resets = RESETS[name]
    options = dict(options)
    op = options.pop("op")
    case = testing.make_case(op, key_dim=24, value_dim=40, **H0_HT, **options)
    for gate, indices in resets.items():
        case = testing.with_values(case, gate, indices, -np.inf)
    check_resets(dispatched(op, interpret), case, resets)


def test_huge_and_strong_finite_decays_match_the_oracle(interpret):
    """g = -1e30 (floored like -inf) next to finite decays of -60 per step (|g| C = 7680 at chunk 128)."""
    case = testing.make_case("simple_gla", batch=2, seq_len=140, key_dim=16, value_dim=24, chunk_size=128, **H0_HT)
    huge = [(0, 3, 0), (1, 127, 1), (1, 128, 0)]
    case = testing.with_values(case, "g", [(0, slice(60, 90), 1), (1, slice(100, 140), 0)], -60.0)
    case = testing.with_values(case, "g", huge, -1e30)
    check_resets(dispatched("simple_gla", interpret), case, {"g": huge})


# --------------------------------------------------------------------------- causality

CAUSALITY = {
    "simple_gla B=2 H=2 chunk 16": dict(op="simple_gla", gates=("g", "g_gamma"), batch=2, seq_len=50, chunk_size=16),
    "gla varlen H=2 chunk 16": dict(op="gla", seq_len=60, cu_seqlens=[0, 21, 22, 60], chunk_size=16),
}
POISONS = {"q=nan": ("q", np.nan), "k=nan": ("k", np.nan), "v=inf": ("v", np.inf), "v=nan": ("v", np.nan)}
# (case, poison) pairs: every poison once per layout
CAUSALITY_CASES = [
    ("simple_gla B=2 H=2 chunk 16", "k=nan"),
    ("simple_gla B=2 H=2 chunk 16", "v=inf"),
    ("gla varlen H=2 chunk 16", "q=nan"),
    ("gla varlen H=2 chunk 16", "v=nan"),
]
POISONED_STEP, POISONED_ROW, POISONED_HEAD = 37, 0, 1  # inside a chunk; varlen: in the third sequence


def unaffected(name: str, shape, case: testing.Case, tensor: str):
    """Bool mask of the elements of output or gradient `name` a non-finite `tensor` at the poisoned
    (row, step, head) must not change: other rows, heads and packed sequences; for o also the
    earlier steps of its own sequence (and the later ones for q)."""
    mask = np.ones(shape, bool)
    head, cu = POISONED_HEAD, case.options["cu_seqlens"]
    if cu is None:
        sequence, row, tokens = POISONED_ROW, POISONED_ROW, slice(None)
    else:
        cu = np.asarray(cu)
        sequence = int(np.searchsorted(cu, POISONED_STEP, side="right")) - 1
        row, tokens = 0, slice(int(cu[sequence]), int(cu[sequence + 1]))
    if name in ("final_state", "dinitial_state"):
        mask[sequence, head] = False
    elif name == "dg_gamma":
        mask[head] = False
    elif name == "o":
        last_clean = POISONED_STEP + 1 if tensor == "q" else (tokens.stop or shape[1])
        mask[row, POISONED_STEP:last_clean, head] = False
    else:
        mask[row, tokens, head] = False
    return mask


@pytest.mark.parametrize("name, poison", CAUSALITY_CASES)
def test_a_non_finite_input_reaches_no_earlier_output_nor_other_sequences(name, poison, interpret):
    options = dict(CAUSALITY[name])
    op = options.pop("op")
    tensor, value = POISONS[poison]
    case = testing.make_case(op, key_dim=8, value_dim=8, **H0_HT, **options)
    case = testing.with_values(case, tensor, [(POISONED_ROW, POISONED_STEP, POISONED_HEAD)], value)
    outputs, grads, reference = testing.forward_and_vjp(dispatched(op, interpret), case)
    tolerance = testing.tolerance_for(case.dtype)
    for label, got, expected, tol in [
        *((n, outputs[n], reference.outputs[n], tolerance.output) for n in outputs),
        *((n, grads[n], reference.grads[n], tolerance.grad) for n in grads),
    ]:
        mask = unaffected(label, got.shape, case, tensor)
        testing.assert_close(f"{label} (unaffected part)", got[mask], expected[mask], tol, label=case.label)
        # the affected part may be NaN (gradients: also at earlier steps of the poisoned chunk), but
        # never a finite number the recurrence does not give
        finite = ~mask & np.isfinite(got)
        assert np.isfinite(expected[finite]).all(), f"{label}: finite where the recurrence is not"
        testing.assert_close(f"{label} (finite affected part)", got[finite], expected[finite], tol, label=case.label)
    # from the poisoned step to the end of its sequence: no finite (silently wrong) output
    o = outputs["o"][POISONED_ROW, :, POISONED_HEAD]
    affected = ~unaffected("o", outputs["o"].shape, case, tensor)[POISONED_ROW, :, POISONED_HEAD]
    assert not np.isfinite(o[affected]).any(), f"finite outputs at steps {np.flatnonzero(np.isfinite(o) & affected)}"


# --------------------------------------------------------------------------- empty inputs

EMPTY = {
    "B=0": dict(batch=0, seq_len=9),
    "T=0": dict(batch=2, seq_len=0),
    "varlen all empty": dict(batch=1, seq_len=0, cu_seqlens=[0, 0, 0]),
}


@pytest.mark.parametrize("op", ["simple_gla", "gla"])
@pytest.mark.parametrize("name", EMPTY)
def test_empty_inputs(name, op, interpret):
    """Empty o, final state = initial state (zeros without one), gradients of the right shape
    (d initial_state = the final-state cotangent)."""
    shape = EMPTY[name]
    batch, seq_len, cu = shape["batch"], shape["seq_len"], shape.get("cu_seqlens")
    heads, key_dim, value_dim = 2, 8, 4
    num_states = batch if cu is None else len(cu) - 1
    rng = np.random.default_rng(0)
    q = jnp.zeros((batch, seq_len, heads, key_dim), jnp.float32)
    v = jnp.zeros((batch, seq_len, heads, value_dim), jnp.float32)
    gates = {"g": jnp.zeros((batch, seq_len, heads)), "g_gamma": jnp.full((heads,), -0.5)}
    gates = gates if op == "simple_gla" else {"gk": jnp.zeros(q.shape)}
    h0 = jnp.asarray(rng.standard_normal((num_states, heads, key_dim, value_dim)), jnp.float32)
    dht = jnp.asarray(rng.standard_normal(h0.shape), jnp.float32)
    extra = {} if cu is None else {"cu_seqlens": jnp.asarray(cu, jnp.int32)}
    fn = dispatched(op, interpret)

    def loss(q, v, gates, h0):
        o, final = fn(q=q, k=q, v=v, **gates, initial_state=h0, output_final_state=True, **extra)
        return jnp.sum(o) + jnp.sum(final * dht), (o, final)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (_, (o, final)), (dq, dv, d_gates, dh0) = grad(q, v, gates, h0)
    assert o.shape == v.shape and dq.shape == q.shape and dv.shape == v.shape
    assert all(d_gates[n].shape == gates[n].shape and not bool(jnp.any(d_gates[n])) for n in gates)
    testing.assert_close("final_state", final, h0, 0.0)
    testing.assert_close("d initial_state", dh0, dht, 0.0)
    o, final = fn(q=q, k=q, v=v, **gates, output_final_state=True, **extra)
    assert o.shape == v.shape and final.shape == h0.shape and not bool(jnp.any(final))


# --------------------------------------------------------------------------- float64


@pytest.mark.parametrize("op", ["simple_gla", "gla"])
def test_float64_inputs_are_declined_with_a_reason(op, interpret):
    with jax.enable_x64(True):
        case = testing.make_case(op, seq_len=20, key_dim=8, value_dim=8, dtype=jnp.float64)
        inputs = {n: x.astype(jnp.float64) for n, x in case.inputs.items()}
        kwargs = {**inputs, **case.options, "interpret": interpret}
        resolution = gla_core.explain(op, **kwargs)
        (candidate,) = [c for c in resolution.candidates if c.implementation.name == IMPL]
        assert not candidate.accepted and "float64" in candidate.reason
        assert f"{IMPL}" in resolution.report() and "float64" in resolution.report()
        with pytest.raises(errors.ImplementationDeclinedError, match="float64"):
            gla_core.dispatch(op, impl=IMPL, **kwargs)


# --------------------------------------------------------------------------- transformations


def _loss(op: str, interpret: bool, case: testing.Case):
    fn = dispatched(op, interpret)

    def loss(q, **others):
        o, final_state = fn(**{**case.kwargs(), **others, "q": q})
        return jnp.sum(o**2) + jnp.sum(final_state**2)

    return loss


SECOND_ORDER = {
    "grad of grad": lambda loss, q: jax.grad(lambda q: jnp.sum(jax.grad(loss)(q) ** 2))(q),
    "jvp of the vjp": lambda loss, q: jax.jvp(jax.vjp(loss, q)[1], (jnp.ones(()),), (jnp.ones(()),)),
}


@pytest.mark.parametrize("how", SECOND_ORDER)
@pytest.mark.parametrize("op", ["simple_gla", "gla"])
def test_higher_order_derivatives_raise_a_clear_error(op, how, interpret):
    case = testing.make_case(op, seq_len=20, key_dim=8, value_dim=8, chunk_size=16, **H0_HT)
    with pytest.raises(HigherOrderDerivativeError, match=rf"{op}.*impl='{IMPL}'.*impl='xla'"):
        SECOND_ORDER[how](_loss(op, interpret, case), case.inputs["q"])


def _shared(cases: list[testing.Case], *names: str) -> list[testing.Case]:
    """The cases with the inputs `names` of the first case."""
    return [dataclasses.replace(c, inputs={**c.inputs, **{n: cases[0].inputs[n] for n in names}}) for c in cases]


VMAPS = {
    # every input mapped, g_gamma too; the mapped axis folds into B
    "simple_gla g+g_gamma chunk 16": (
        lambda seed, **h0_ht: testing.make_case(
            "simple_gla",
            batch=2,
            seq_len=40,
            gates=("g", "g_gamma"),
            chunk_size=16,
            gate_scale=1 + seed,
            seed=seed,
            **h0_ht,
        ),
        (),
    ),
    # an unmapped initial state, broadcast to every mapped element
    "gla shared initial_state chunk 32": (
        lambda seed, **h0_ht: testing.make_case("gla", seq_len=50, chunk_size=32, seed=seed, **h0_ht),
        ("initial_state",),
    ),
    # packed sequences with shared boundaries: per-sequence states fold as b * N + sequence
    "simple_gla varlen shared cu_seqlens": (
        lambda seed, **h0_ht: testing.make_case(
            "simple_gla", seq_len=40, cu_seqlens=[0, 13, 13, 14, 40], chunk_size=16, seed=seed, **h0_ht
        ),
        ("cu_seqlens",),
    ),
    # boundaries that differ per element cannot fold: the kernels run once per element
    "gla varlen per-element cu_seqlens": (
        lambda seed, **h0_ht: testing.make_case(
            "gla", seq_len=40, cu_seqlens=[[0, 13, 40], [0, 0, 40]][seed], chunk_size=16, seed=seed, **h0_ht
        ),
        (),
    ),
}


@pytest.mark.parametrize("name", VMAPS)
def test_vmap_matches_the_oracle_per_element(name, interpret):
    make, shared = VMAPS[name]
    cases = [make(seed, **H0_HT) for seed in range(2)]
    cases = _shared(cases, *(n for n in shared if n != "cu_seqlens"))
    testing.vmapped_against_oracle(dispatched(cases[0].op, interpret), cases, set(shared))


# --------------------------------------------------------------------------- anchored products

ANCHOR_CHUNK = 64


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gates_at_the_anchor_range_match_the_oracle(dtype, interpret):
    """gla's per-key gate takes anchored products (`gla_core.chunk.anchored`) in a grid step whose
    in-chunk exponents stay within the default anchor range of the dtype, and the exact products
    beyond it. Chunks just inside, just outside and far outside that range, one chunk per step,
    all match the oracle. With a constant decay d per step the largest in-chunk exponent about
    the anchor row is d * C / 2."""
    from gla_core.chunk.anchored import default_anchor_range

    limit = default_anchor_range(dtype) / (ANCHOR_CHUNK / 2)  # the per-step decay at the range
    per_chunk = [0.97 * limit, 1.03 * limit, 0.5 * limit, 3.0 * limit]
    seq_len = len(per_chunk) * ANCHOR_CHUNK - 10
    case = testing.make_case(
        "gla", batch=2, seq_len=seq_len, key_dim=40, value_dim=24, chunk_size=ANCHOR_CHUNK, dtype=dtype, **H0_HT
    )
    steps = np.repeat(np.asarray(per_chunk), ANCHOR_CHUNK)[:seq_len]
    # every key decays by d at some steps and by less elsewhere, so the range is reached per key
    spread = np.random.default_rng(0).uniform(0.25, 1.0, case.inputs["gk"].shape)
    spread[:, ::7] = 1.0
    gk = -steps[None, :, None, None] * spread
    case = dataclasses.replace(case, inputs={**case.inputs, "gk": jnp.asarray(gk, jnp.float32)})
    fn = lambda **kwargs: gla_core.dispatch(
        "gla", impl=IMPL, interpret=interpret, impl_options={IMPL: {"block_chunks": 1}}, **kwargs
    )
    testing.check_against_oracle(fn, case)


def test_anchor_range_option_zero_takes_the_exact_products_everywhere(interpret):
    case = testing.make_case("gla", seq_len=70, key_dim=24, value_dim=40, chunk_size=32, **H0_HT)
    for anchor_range in (0, 60.0):
        fn = lambda anchor_range=anchor_range, **kwargs: gla_core.dispatch(
            "gla", impl=IMPL, interpret=interpret, impl_options={IMPL: {"anchor_range": anchor_range}}, **kwargs
        )
        testing.check_against_oracle(fn, case)


def test_kernel_chunk_option_is_checked_and_set_by_the_v6e_table():
    case = testing.make_case("gla", seq_len=8, key_dim=8, value_dim=8)
    with pytest.raises(errors.InvalidArgumentError, match=r"kernel_chunk: expected one of \(16, 32, 64, 128\), got 96"):
        gla_core.dispatch("gla", impl=IMPL, interpret=True, impl_options={IMPL: {"kernel_chunk": 96}}, **case.kwargs())
    kwargs = case.kwargs()
    with gla_core.use(backend="tpu", chip="v6e"):
        options = gla_core.explain("gla", **kwargs).options
    assert (options["kernel_chunk"], options["step_chunks"]) == (128, 16)
    simple = testing.make_case("simple_gla", seq_len=8, key_dim=8, value_dim=8).kwargs()
    with gla_core.use(backend="tpu", chip="v6e"):
        options = gla_core.explain("simple_gla", impl=IMPL, **simple).options
    assert (options["kernel_chunk"], options["step_chunks"]) == (128, 16)
    with gla_core.use(backend="tpu"):  # traced for no TPU chip: no table, the call's chunk_size
        assert gla_core.explain("gla", **kwargs).options["kernel_chunk"] is None


@pytest.mark.parametrize("cu_seqlens", [None, [0, 100, 101, 256]])
def test_simple_gla_at_kernel_chunk_128(cu_seqlens, interpret):
    """v6e's table runs simple_gla's chunk kernels at chunks of 128: fixed length (token-major kernels)
    and packed sequences (head-major kernels), forward and gradients."""
    case = testing.make_case(
        "simple_gla", seq_len=256, gates=("g", "g_gamma"), cu_seqlens=cu_seqlens, chunk_size=32, seed=29, **H0_HT
    )
    fn = lambda **kwargs: gla_core.dispatch(
        "simple_gla", impl=IMPL, interpret=interpret, impl_options={IMPL: {"kernel_chunk": 128}}, **kwargs
    )
    errors = testing.check_against_oracle(fn, case)
    assert {"o", "final_state", "dq", "dg", "dg_gamma", "dinitial_state"} <= set(errors)


def test_anchor_range_option_is_checked():
    case = testing.make_case("gla", seq_len=8, key_dim=8, value_dim=8)
    with pytest.raises(errors.InvalidArgumentError, match=r"anchor_range: expected None .* got -1"):
        gla_core.dispatch("gla", impl=IMPL, interpret=True, impl_options={IMPL: {"anchor_range": -1}}, **case.kwargs())
