"""The recurrences against independent formulas and against each other (float64)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_core.errors import InvalidArgumentError, ShapeError
from gla_ref import recurrent
from gla_ref.testing import TOLERANCES, make_case, relative_error

# Same float64 arithmetic along different paths: differences are a few ulps.
TOL = TOLERANCES["float64_identity"].output


def _float64_inputs(case):
    return {n: jnp.asarray(np.asarray(x, np.float64)) for n, x in case.inputs.items()}


def _options(case, **overrides):
    options = {n: v for n, v in case.options.items() if n != "chunk_size"}
    options.update(overrides)
    return options


def _vjp(fn, inputs, names, seed=0):
    """Outputs and the VJP over `names` with seeded cotangents; returns (outputs, {name: grad})."""

    def forward(*values):
        return fn(**{**inputs, **dict(zip(names, values, strict=True))})

    outputs, vjp = jax.vjp(forward, *(inputs[n] for n in names))
    rng = np.random.default_rng(seed)
    cotangents = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape)), outputs)
    return outputs, dict(zip(names, vjp(cotangents), strict=True))


def test_simple_gla_matches_quadratic_form(x64):
    """o_t = scale * sum_{s <= t} exp(G_t - G_s) (q_t . k_s) v_s + scale * exp(G_t) q_t^T h0, G = cumsum(g)."""
    case = make_case(
        "simple_gla", batch=2, seq_len=20, key_dim=4, value_dim=3, gates=("g", "g_gamma"), initial_state=True
    )
    x = {n: np.asarray(v, np.float64) for n, v in case.inputs.items()}
    o, _ = recurrent.simple_gla(**_float64_inputs(case), scale=0.7)
    G = np.cumsum(x["g"] + x["g_gamma"], axis=1)  # [B, T, H]
    decay = np.exp(G[:, :, None] - G[:, None, :]) * np.tril(np.ones((20, 20)))[None, :, :, None]
    scores = np.einsum("bthk,bshk->btsh", x["q"], x["k"]) * decay
    expected = np.einsum("btsh,bshv->bthv", scores, x["v"])
    expected += np.einsum("bth,bthk,bhkv->bthv", np.exp(G), x["q"], x["initial_state"])
    assert relative_error(o, 0.7 * expected) <= TOL


def test_g_gamma_equals_broadcast_g(x64):
    case = make_case("simple_gla", batch=2, seq_len=30, gates=("g_gamma",), key_dim=8, value_dim=4, initial_state=True)
    inputs = _float64_inputs(case)
    g_gamma = inputs.pop("g_gamma")
    g = jnp.broadcast_to(g_gamma, (2, 30, 2))
    run = lambda **kw: recurrent.simple_gla(**kw, output_final_state=True)
    (o1, h1), grads1 = _vjp(run, {**inputs, "g_gamma": g_gamma}, ("q", "g_gamma", "initial_state"))
    (o2, h2), grads2 = _vjp(run, {**inputs, "g": g}, ("q", "g", "initial_state"))
    assert relative_error(o1, o2) <= TOL and relative_error(h1, h2) <= TOL
    assert relative_error(grads1["q"], grads2["q"]) <= TOL
    assert relative_error(grads1["initial_state"], grads2["initial_state"]) <= TOL
    assert relative_error(grads1["g_gamma"], grads2["g"].sum(axis=(0, 1))) <= TOL


def test_g_plus_g_gamma_is_their_sum(x64):
    case = make_case("simple_gla", seq_len=25, gates=("g", "g_gamma"), key_dim=8, value_dim=4)
    inputs = _float64_inputs(case)
    both, _ = recurrent.simple_gla(**inputs)
    summed, _ = recurrent.simple_gla(inputs["q"], inputs["k"], inputs["v"], g=inputs["g"] + inputs["g_gamma"])
    assert relative_error(both, summed) <= TOL


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
def test_gla_with_gate_constant_over_keys_equals_simple_gla(x64, varlen):
    cu = [0, 5, 5, 40] if varlen else None
    case = make_case("simple_gla", batch=1 if varlen else 2, seq_len=40, key_dim=8, value_dim=4, cu_seqlens=cu,
                     initial_state=True)  # fmt: skip
    inputs = _float64_inputs(case)
    g = inputs.pop("g")
    gk = jnp.broadcast_to(g[..., None], (*g.shape, 8))
    options = dict(cu_seqlens=case.options["cu_seqlens"], output_final_state=True)
    (o1, h1), grads1 = _vjp(lambda **kw: recurrent.simple_gla(**kw, **options), {**inputs, "g": g}, ("k", "g"))
    (o2, h2), grads2 = _vjp(lambda **kw: recurrent.gla(**kw, **options), {**inputs, "gk": gk}, ("k", "gk"))
    assert relative_error(o1, o2) <= TOL and relative_error(h1, h2) <= TOL
    assert relative_error(grads1["k"], grads2["k"]) <= TOL
    assert relative_error(grads1["g"], grads2["gk"].sum(axis=-1)) <= TOL


def test_simple_gla_without_gates_equals_gla_with_zero_gate(x64):
    case = make_case("gla", seq_len=20, key_dim=8, value_dim=4, initial_state=True)
    inputs = _float64_inputs(case)
    gk = inputs.pop("gk")
    o1, h1 = recurrent.simple_gla(**inputs, output_final_state=True)
    o2, h2 = recurrent.gla(**inputs, gk=jnp.zeros_like(gk), output_final_state=True)
    assert relative_error(o1, o2) <= TOL and relative_error(h1, h2) <= TOL


@pytest.mark.parametrize("use_gate_in_kernel", [False, True], ids=["g", "gate_in_kernel"])
def test_kda_with_zero_beta_only_decays_the_state(x64, use_gate_in_kernel):
    case = make_case("kda", batch=2, seq_len=12, num_heads=2, num_value_heads=4, key_dim=5, value_dim=3,
                     initial_state=True, use_gate_in_kernel=use_gate_in_kernel)  # fmt: skip
    inputs = _float64_inputs(case)
    inputs["beta"] = jnp.zeros_like(inputs["beta"])
    o, final_state = recurrent.kda(**inputs, **_options(case, output_final_state=True, scale=0.3))
    g = recurrent.kda_gate(inputs["g"], inputs["A_log"], inputs["dt_bias"]) if use_gate_in_kernel else inputs["g"]
    G = np.cumsum(np.asarray(g), axis=1)  # [B, T, HV, K]
    states = np.exp(G)[..., None] * np.asarray(inputs["initial_state"])[:, None]  # [B, T, HV, K, V]
    q = np.repeat(np.asarray(inputs["q"]), 2, axis=2)  # value head j reads q head j // 2
    assert relative_error(o, 0.3 * np.einsum("bthk,bthkv->bthv", q, states)) <= TOL
    assert relative_error(final_state, states[:, -1]) <= TOL


def test_kda_grouped_value_heads_read_their_query_head(x64):
    case = make_case("kda", seq_len=16, num_heads=2, num_value_heads=6, key_dim=4, value_dim=3, initial_state=True)
    inputs = _float64_inputs(case)
    grouped, grouped_state = recurrent.kda(**inputs, output_final_state=True)
    expanded = {**inputs, "q": jnp.repeat(inputs["q"], 3, axis=2), "k": jnp.repeat(inputs["k"], 3, axis=2)}
    flat, flat_state = recurrent.kda(**expanded, output_final_state=True)
    assert relative_error(grouped, flat) <= TOL and relative_error(grouped_state, flat_state) <= TOL


def test_kda_in_kernel_flags_equal_explicit_transforms(x64):
    case = make_case("kda", seq_len=16, key_dim=4, value_dim=3, initial_state=True, use_qk_l2norm_in_kernel=True,
                     use_gate_in_kernel=True, lower_bound=-2.0, use_beta_sigmoid_in_kernel=True)  # fmt: skip
    inputs = _float64_inputs(case)
    o1, h1 = recurrent.kda(**inputs, **_options(case, output_final_state=True))
    norm = lambda x: x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)
    A = jnp.exp(inputs["A_log"])[:, None]
    g = -2.0 * jax.nn.sigmoid(A * (inputs["g"] + inputs["dt_bias"].reshape(2, 4)))
    explicit = dict(q=norm(inputs["q"]), k=norm(inputs["k"]), v=inputs["v"], g=g, beta=jax.nn.sigmoid(inputs["beta"]))
    o2, h2 = recurrent.kda(**explicit, initial_state=inputs["initial_state"], output_final_state=True)
    assert relative_error(o1, o2) <= TOL and relative_error(h1, h2) <= TOL


@pytest.mark.parametrize("lower_bound", [None, -3.0])
@pytest.mark.parametrize("dt_bias", [True, False])
def test_kda_gate_formula(x64, dt_bias, lower_bound):
    case = make_case("kda_gate", seq_len=5, num_heads=3, key_dim=4, dt_bias=dt_bias, lower_bound=lower_bound)
    x = {n: np.asarray(v, np.float64) for n, v in case.inputs.items()}
    gate = recurrent.kda_gate(**_float64_inputs(case), lower_bound=lower_bound)
    z = x["g"] + (x["dt_bias"].reshape(3, 4) if dt_bias else 0.0)
    rate = np.exp(x["A_log"])[:, None]
    expected = -rate * np.log1p(np.exp(z)) if lower_bound is None else lower_bound / (1 + np.exp(-rate * z))
    assert gate.shape == (1, 5, 3, 4) and gate.dtype == jnp.float64
    assert relative_error(gate, expected) <= TOL
    assert (np.asarray(gate) < 0).all()


@pytest.mark.parametrize("op", ["simple_gla", "gla", "kda"])
def test_varlen_equals_per_sequence_runs(x64, op):
    cu = [0, 7, 7, 8, 30]
    case = make_case(op, seq_len=30, key_dim=6, value_dim=4, cu_seqlens=cu, initial_state=True, num_value_heads=None)
    inputs = _float64_inputs(case)
    fn = getattr(recurrent, op)
    o, final_state = fn(**inputs, **_options(case, output_final_state=True))
    time_inputs = {n: x for n, x in inputs.items() if n not in ("initial_state", "g_gamma", "A_log", "dt_bias")}
    for n, (start, end) in enumerate(itertools.pairwise(cu)):
        piece = {name: x[:, start:end] for name, x in time_inputs.items()}
        state = inputs["initial_state"][n : n + 1]
        if start == end:
            assert relative_error(final_state[n], state[0]) == 0.0
            continue
        o_n, final_n = fn(**piece, initial_state=state, **_options(case, output_final_state=True, cu_seqlens=None))
        assert relative_error(o[:, start:end], o_n) <= TOL
        assert relative_error(final_state[n], final_n[0]) <= TOL


def test_varlen_boundaries_may_be_traced_without_recompiling(x64):
    case = make_case("gla", seq_len=24, key_dim=4, value_dim=4, cu_seqlens=[0, 10, 24], initial_state=True)
    inputs = _float64_inputs(case)
    run = jax.jit(lambda cu: recurrent.gla(**inputs, cu_seqlens=cu, output_final_state=True))
    for boundaries in ([0, 10, 24], [0, 0, 24], [0, 23, 24]):
        cu = jnp.asarray(boundaries, jnp.int32)
        o, final_state = run(cu)
        o_eager, final_eager = recurrent.gla(**inputs, cu_seqlens=cu, output_final_state=True)
        assert relative_error(o, o_eager) <= TOL and relative_error(final_state, final_eager) <= TOL
    assert run._cache_size() == 1


def test_empty_sequences_without_initial_state_end_in_zeros(x64):
    case = make_case("simple_gla", seq_len=6, key_dim=4, value_dim=4, cu_seqlens=[0, 0, 6, 6])
    _, final_state = recurrent.simple_gla(**_float64_inputs(case), **_options(case, output_final_state=True))
    assert final_state.shape == (3, 2, 4, 4)
    assert not np.asarray(final_state[0]).any() and not np.asarray(final_state[2]).any()
    assert np.asarray(final_state[1]).any()


def test_computation_dtype_is_promoted_to_float32():
    case = make_case("gla", seq_len=8, key_dim=4, value_dim=4, dtype=jnp.bfloat16, initial_state=True)
    o, final_state = recurrent.gla(**case.inputs, output_final_state=True)
    assert o.dtype == jnp.float32 and final_state.dtype == jnp.float32


def test_bad_arguments_name_the_argument():
    case = make_case("kda", seq_len=8, key_dim=4, value_dim=4, initial_state=True)
    with pytest.raises(ShapeError, match="initial_state"):
        recurrent.kda(**{**case.inputs, "initial_state": case.inputs["initial_state"][:, :1]})
    with pytest.raises(InvalidArgumentError, match="A_log"):
        recurrent.kda(**case.inputs, use_gate_in_kernel=True)
    with pytest.raises(InvalidArgumentError, match="allow_neg_eigval"):
        recurrent.kda(**case.inputs, allow_neg_eigval=True)
    with pytest.raises(InvalidArgumentError, match="A_log"):
        recurrent.kda(**case.inputs, A_log=jnp.zeros((2,)))
    batched = make_case("gla", batch=2, seq_len=8, key_dim=4, value_dim=4)
    with pytest.raises(ShapeError, match="cu_seqlens"):
        recurrent.gla(**batched.inputs, cu_seqlens=jnp.asarray([0, 8], jnp.int32))
