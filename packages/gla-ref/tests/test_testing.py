"""The test helpers of gla_ref.testing: errors, tolerances, cases and the oracle comparison."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_ref import recurrent, testing
from gla_ref.testing import (
    TOLERANCES,
    Case,
    alibi_g_gamma,
    assert_close,
    check_against_oracle,
    compare_with_oracle,
    make_case,
    oracle,
    random_cu_seqlens,
    relative_error,
)

# ------------------------------------------------------------------ relative_error / assert_close


def test_relative_error_values():
    ref = np.array([[1.0, -2.0], [0.5, 0.0]])
    assert relative_error(ref, ref) == 0.0
    x = ref.copy()
    x[1, 0] += 0.5
    assert relative_error(x, ref) == 0.25  # 0.5 / max|ref| = 0.5 / 2
    assert relative_error(np.zeros(3), np.zeros(3)) == 0.0
    assert relative_error(np.zeros((0, 4)), np.zeros((0, 4))) == 0.0
    assert relative_error(np.ones(3), np.zeros(3)) >= 1e299  # measured against float64's resolution floor
    assert relative_error(np.ones(3, np.int32), np.zeros(3)) == math.inf
    assert relative_error(np.array([1.0, np.nan]), np.ones(2)) == math.inf
    assert relative_error(np.array([1.0, np.inf]), np.ones(2)) == math.inf


def test_relative_error_of_values_below_float32_resolution_uses_the_floor():
    """A float32 gradient of 0 where the float64 one is 7e-33 is not a 100% error: float32 cannot
    resolve such values (TESTING.RESOLUTION_FLOOR), while O(1) errors still are."""
    tiny = np.array([7e-33, -3e-34])
    assert relative_error(np.zeros(2, np.float32), tiny) < 1e-2
    assert relative_error(np.zeros(2, np.float64), tiny) == 1.0
    assert relative_error(np.array([1.0, 0.0], np.float32), np.array([2.0, 0.0])) == 0.5


def test_relative_error_computes_in_float64():
    ref = jnp.asarray([1.0, 2.0, 3.0], jnp.bfloat16)
    x = ref.astype(jnp.float32) + jnp.asarray([0.0, 0.0, 3e-3], jnp.float32)
    assert relative_error(x, ref) == pytest.approx(1e-3, rel=1e-4)


def test_relative_error_rejects_shape_mismatch():
    with pytest.raises(ValueError, match=r"\(3,\).*\(4,\)"):
        relative_error(np.ones(3), np.ones(4))


def test_assert_close_message_names_tensor_error_and_worst_element():
    ref = np.arange(12, dtype=np.float64).reshape(3, 4)
    x = ref.copy()
    x[2, 1] = 100.0
    assert_close("dq", ref + 1e-9, ref, tol=1e-6)
    with pytest.raises(AssertionError) as error:
        assert_close("dq", x, ref, tol=1e-3)
    message = str(error.value)
    assert "dq" in message
    assert f"{91 / 11:.3e}" in message  # |100 - 9| / max|ref| = 91 / 11
    assert "1.0e-03" in message
    assert "(2, 1)" in message
    assert "got 100" in message and "expected 9" in message


def test_assert_close_reports_nan_position():
    x = np.ones((2, 2))
    x[0, 1] = np.nan
    with pytest.raises(AssertionError, match=r"index \(0, 1\): got nan"):
        assert_close("o", x, np.ones((2, 2)), tol=1.0)


# ------------------------------------------------------------------ tolerances, alibi, cu_seqlens


def test_tolerances():
    assert TOLERANCES["float32"].output == 1e-5 and TOLERANCES["float32"].grad == 1e-4
    bf16 = TOLERANCES["bfloat16"]
    assert bf16.output > TOLERANCES["float32"].output and bf16.grad > TOLERANCES["float32"].grad
    assert bf16.grad >= bf16.output
    assert "bf16" in bf16.reason or "bfloat16" in bf16.reason
    assert testing.tolerance_for(jnp.bfloat16) is bf16
    assert testing.tolerance_for(jnp.float64) is TOLERANCES["float64"]
    assert TOLERANCES["float64"].output <= 1e-12
    assert all(t.reason for t in TOLERANCES.values())
    with pytest.raises(KeyError, match="float16"):
        testing.tolerance_for(jnp.float16)


def test_alibi_g_gamma():
    slopes = alibi_g_gamma(8)
    assert slopes.shape == (8,) and slopes.dtype == np.float32
    np.testing.assert_array_equal(slopes, -(2.0 ** -np.arange(1, 9)))
    assert (alibi_g_gamma(3) < 0).all()


@pytest.mark.parametrize("allow_empty", [True, False])
def test_random_cu_seqlens(allow_empty):
    rng = np.random.default_rng(0)
    seen_empty = False
    for _ in range(50):
        cu = random_cu_seqlens(37, 5, rng, allow_empty=allow_empty)
        assert len(cu) == 6 and cu[0] == 0 and cu[-1] == 37
        steps = np.diff(cu)
        assert (steps >= 0).all()
        assert allow_empty or (steps > 0).all()
        seen_empty |= bool((steps == 0).any())
    assert seen_empty == allow_empty
    assert random_cu_seqlens(10, 1, rng) == [0, 10]
    with pytest.raises(ValueError, match="total_len"):
        random_cu_seqlens(3, 5, rng, allow_empty=False)


# ------------------------------------------------------------------ make_case

CASE_OPTIONS = {
    "simple_gla-default": dict(op="simple_gla"),
    "simple_gla-g_gamma-h0-ht": dict(op="simple_gla", gates=("g_gamma",), initial_state=True, output_final_state=True),
    "simple_gla-g+g_gamma-varlen": dict(op="simple_gla", gates=("g", "g_gamma"), cu_seqlens=[0, 10, 10, 64]),
    "simple_gla-no-gates": dict(op="simple_gla", gates=()),
    "gla-batch": dict(op="gla", batch=3, gates=("g",)),
    "kda-plain": dict(op="kda"),
    "kda-grouped-all-flags": dict(
        op="kda",
        num_value_heads=4,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        lower_bound=-5.0,
        use_beta_sigmoid_in_kernel=True,
        initial_state=True,
        cu_seqlens=[0, 30, 64],
    ),
    "kda-gate-no-dt_bias": dict(op="kda", use_gate_in_kernel=True, dt_bias=False),
    "kda_gate": dict(op="kda_gate", num_value_heads=4),
    "kda_gate-no-dt_bias-lower_bound": dict(op="kda_gate", dt_bias=False, lower_bound=-2.0),
}


@pytest.mark.parametrize("options", list(CASE_OPTIONS.values()), ids=list(CASE_OPTIONS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_make_case_shapes(options, dtype):
    options = dict(options)
    op = options.pop("op")
    B, T, H, K, V = options.get("batch", 1), 64, 2, 32, 32
    HV = options.get("num_value_heads") or H
    case = make_case(op, dtype=dtype, seed=3, **options)
    assert isinstance(case, Case) and case.op == op
    assert case.differentiable == tuple(case.inputs)
    assert case.kwargs() == {**case.inputs, **case.options}
    assert op in case.label and jnp.dtype(dtype).name in case.label
    assert case.dtype == jnp.dtype(dtype)
    cu = options.get("cu_seqlens")
    N = B if cu is None else len(cu) - 1
    expected = {
        "q": (B, T, H, K),
        "k": (B, T, H, K),
        "v": (B, T, HV, V),
        "g": (B, T, H) if op == "simple_gla" else (B, T, HV, K),
        "g_gamma": (H,),
        "gk": (B, T, H, K),
        "beta": (B, T, HV),
        "initial_state": (N, HV, K, V),
        "A_log": (HV,),
        "dt_bias": (HV * K,),
    }
    names = set(case.inputs)
    if op == "simple_gla":
        assert names == {"q", "k", "v", *options.get("gates", ("g",))} | ({"initial_state"} & _state(options))
    elif op == "gla":
        assert names == {"q", "k", "v", "gk"}
    elif op == "kda":
        gate = {"A_log"} | ({"dt_bias"} if options.get("dt_bias", True) else set())
        gate = gate if options.get("use_gate_in_kernel") else set()
        assert names == {"q", "k", "v", "g", "beta"} | _state(options) | gate
    else:
        assert names == {"g", "A_log"} | ({"dt_bias"} if options.get("dt_bias", True) else set())
        assert case.options == {"lower_bound": options.get("lower_bound")}
        assert case.output_names == ("gate",)
    for name, x in case.inputs.items():
        assert x.shape == expected[name], name
        float32_input = name in ("g_gamma", "A_log", "dt_bias", "initial_state")
        assert x.dtype == (jnp.float32 if float32_input else jnp.dtype(dtype)), name
        assert np.isfinite(np.asarray(x, np.float64)).all(), name
    if op != "kda_gate":
        assert case.options["chunk_size"] == 64 and case.options["scale"] is None
        assert case.options["output_final_state"] == options.get("output_final_state", False)
        if cu is None:
            assert case.options["cu_seqlens"] is None
        else:
            assert case.options["cu_seqlens"].dtype == jnp.int32
            assert case.options["cu_seqlens"].tolist() == cu


def _state(options):
    return {"initial_state"} if options.get("initial_state") else set()


def test_make_case_values_are_realistic():
    kda = make_case("kda", seq_len=256, seed=1)
    k = np.asarray(kda.inputs["k"], np.float64)
    np.testing.assert_allclose(np.linalg.norm(k, axis=-1), 1.0, rtol=1e-6)  # delta-rule stability
    beta = np.asarray(kda.inputs["beta"])
    assert (beta > 0).all() and (beta < 1).all()
    g = np.asarray(kda.inputs["g"])
    assert (g < 0).all() and g.min() >= -5.01 and np.median(g) > -0.5
    logits = np.asarray(make_case("kda", use_beta_sigmoid_in_kernel=True).inputs["beta"])
    assert (logits < 0).any() and (logits > 0).any()
    q = np.asarray(make_case("kda", use_qk_l2norm_in_kernel=True, seq_len=256).inputs["k"])
    assert 0.8 < q.std() < 1.2  # raw N(0, 1): the kernel normalizes
    scaled = make_case("gla", gate_scale=4.0, seq_len=256)
    assert np.asarray(scaled.inputs["gk"]).min() < -5.0
    g_gamma = make_case("simple_gla", gates=("g_gamma",), num_heads=4, gate_scale=2.0).inputs["g_gamma"]
    np.testing.assert_allclose(np.asarray(g_gamma), 2.0 * alibi_g_gamma(4))
    gate = make_case("kda", use_gate_in_kernel=True, seq_len=128)
    decay = np.asarray(recurrent.kda_gate(gate.inputs["g"], gate.inputs["A_log"], gate.inputs["dt_bias"]))
    assert -3.0 < decay.mean() < -0.05


def test_make_case_is_seeded():
    a, b, c = (make_case("gla", seed=s) for s in (5, 5, 6))
    assert all(np.array_equal(a.inputs[n], b.inputs[n]) for n in a.inputs)
    assert not np.array_equal(a.inputs["q"], c.inputs["q"])


def test_make_case_rejects_bad_requests():
    with pytest.raises(ValueError, match="op"):
        make_case("attention")
    with pytest.raises(ValueError, match="batch"):
        make_case("gla", batch=2, cu_seqlens=[0, 64])
    with pytest.raises(ValueError, match="cu_seqlens"):
        make_case("gla", cu_seqlens=[0, 10, 50])
    with pytest.raises(ValueError, match="num_value_heads"):
        make_case("gla", num_value_heads=4)
    with pytest.raises(ValueError, match="num_value_heads"):
        make_case("kda", num_heads=2, num_value_heads=3)
    with pytest.raises(ValueError, match="gates"):
        make_case("simple_gla", gates=("gk",))
    bounded = make_case("kda", lower_bound=-1.0)  # a precomputed gate's bound: g is clipped to it
    assert float(bounded.inputs["g"].min()) >= -1.0 and bounded.options["lower_bound"] == -1.0


# ------------------------------------------------------------------ oracle and comparisons


def test_oracle_outputs_and_gradients_are_float64():
    case = make_case("simple_gla", seq_len=20, key_dim=8, value_dim=8, initial_state=True, output_final_state=True)
    result = oracle(case)
    assert set(result.outputs) == {"o", "final_state"}
    assert set(result.grads) == {"dq", "dk", "dv", "dg", "dinitial_state"}
    assert all(x.dtype == np.float64 for x in (*result.outputs.values(), *result.grads.values()))
    assert result.outputs["o"].shape == (1, 20, 2, 8)
    assert result.grads["dinitial_state"].shape == (1, 2, 8, 8)
    other_seed = oracle(case, cotangent_seed=1)
    np.testing.assert_array_equal(other_seed.outputs["o"], result.outputs["o"])
    assert not np.array_equal(other_seed.grads["dq"], result.grads["dq"])


# The recurrence in float32 against itself in float64: only float32 round-off remains.
FLOAT32_SELF_TOL = TOLERANCES["float32"].output

# gla and kda go through the same comparison in test_plugin.py (via dispatch).
SELF_CASES = {
    "simple_gla-g+g_gamma-varlen-h0-ht": dict(
        op="simple_gla", gates=("g", "g_gamma"), cu_seqlens=[0, 17, 17, 50], initial_state=True, output_final_state=True
    ),
    "kda_gate": dict(op="kda_gate"),
}


@pytest.mark.parametrize("options", list(SELF_CASES.values()), ids=list(SELF_CASES))
def test_compare_with_oracle_of_the_oracle_itself_is_float32_exact(options):
    options = dict(options)
    op = options.pop("op")
    case = make_case(op, seq_len=50, key_dim=16, value_dim=16, **options)
    errors = compare_with_oracle(getattr(recurrent, op), case)
    if op == "kda_gate":
        expected = {"gate", "dg", "dA_log", "ddt_bias"}
    else:
        expected = {"o", "final_state", *("d" + n for n in case.differentiable)}
    assert set(errors) == expected
    assert max(errors.values()) <= FLOAT32_SELF_TOL, errors
    assert check_against_oracle(getattr(recurrent, op), case) == errors


def test_bfloat16_recurrence_passes_the_bfloat16_tolerance():
    case = make_case("gla", seq_len=40, key_dim=16, value_dim=16, dtype=jnp.bfloat16, initial_state=True,
                     output_final_state=True)  # fmt: skip

    def bf16_outputs(**kwargs):
        o, final_state = recurrent.gla(**kwargs)
        return o.astype(jnp.bfloat16), final_state

    errors = check_against_oracle(bf16_outputs, case)
    assert 0 < errors["o"] <= TOLERANCES["bfloat16"].output


def _scaled_wrong(**kwargs):
    o, final_state = recurrent.simple_gla(**kwargs)
    return 1.01 * o, final_state


def _detached_state(**kwargs):
    kwargs["initial_state"] = jax.lax.stop_gradient(kwargs["initial_state"])
    return recurrent.simple_gla(**kwargs)


def _forgets_final_state(**kwargs):
    return recurrent.simple_gla(**kwargs)[0], None


def test_check_against_oracle_catches_wrong_functions():
    case = make_case("simple_gla", seq_len=30, key_dim=8, value_dim=8, initial_state=True, output_final_state=True)
    with pytest.raises(AssertionError) as error:
        check_against_oracle(_scaled_wrong, case)
    message = str(error.value)
    assert case.label in message
    assert "o: relative error" in message and "dq: relative error" in message
    assert "final_state" not in message  # the state is right; only o and what flows from it are wrong
    with pytest.raises(AssertionError, match=r"dinitial_state: relative error 1.000e\+00 .* got 0,"):
        check_against_oracle(_detached_state, case)
    with pytest.raises(AssertionError, match="returned no final_state"):
        compare_with_oracle(_forgets_final_state, case)
    errors = compare_with_oracle(_scaled_wrong, case)
    assert errors["o"] == pytest.approx(0.01, rel=1e-3)


def test_check_against_oracle_takes_explicit_tolerance():
    case = make_case("gla", seq_len=10, key_dim=8, value_dim=8)
    errors = check_against_oracle(recurrent.gla, case, tolerance=1e-5)
    with pytest.raises(AssertionError, match=r"tol 1\.0e-12"):
        check_against_oracle(recurrent.gla, case, tolerance=testing.Tolerance(1e-12, 1e-12, "too tight"))
    assert set(errors) == {"o", "dq", "dk", "dv", "dgk"}


def _cancelling_case() -> testing.Case:
    """simple_gla, one head, K = V = 1, no decay: o_1 = q_1 (k_0 v_0 + k_1 v_1) = 1 - 1 + 2^-6, a sum
    of two terms of size 1 that almost cancel (every value is exact in bfloat16)."""
    column = lambda *values: jnp.asarray(values, jnp.bfloat16).reshape(1, len(values), 1, 1)
    inputs = {"q": column(0.0, 1.0), "k": column(1.0, 1.0), "v": column(1.0, -1.0 + 2.0**-6)}
    return testing.Case("simple_gla", inputs, {"scale": 1.0}, ("q", "k", "v"), "cancelling K=V=1")


def test_rounding_sensitivity_tells_cancellation_from_ordinary_tensors():
    unit = testing.UNIT_ROUNDOFF["bfloat16"]
    ordinary = make_case("simple_gla", seq_len=32, key_dim=16, value_dim=16, dtype=jnp.bfloat16, initial_state=True)
    reference = testing.oracle(ordinary)
    sensitivity = testing.rounding_sensitivity(ordinary, reference)
    for name, value in {**reference.outputs, **reference.grads}.items():
        assert 0 < sensitivity[name] < 10 * unit * np.abs(value).max(), name
    cancelling = _cancelling_case()
    o = testing.oracle(cancelling).outputs["o"]
    assert np.abs(o).max() == 2.0**-6
    assert testing.rounding_sensitivity(cancelling)["o"] > 30 * unit * 2.0**-6


def _rounding_again(**kwargs):
    """The recurrence with k changed by bfloat16's unit roundoff, up at even steps and down at odd ones
    (as a bf16 kernel rounding its operands once more would)."""
    unit = testing.UNIT_ROUNDOFF["bfloat16"]
    steps = kwargs["k"].shape[1]
    factors = np.where(np.arange(steps) % 2 == 0, 1 + unit, 1 - unit).reshape(1, steps, 1, 1).astype(np.float32)
    return recurrent.simple_gla(**{**kwargs, "k": kwargs["k"].astype(jnp.float32) * factors})


def _drops_the_last_value(**kwargs):
    """A wrong recurrence: the last step's value is lost (o_1 = 1 instead of 2^-6)."""
    return recurrent.simple_gla(**{**kwargs, "v": kwargs["v"].at[:, -1].set(0)})


def test_cancellation_lifts_the_bound_to_the_sensitivity_and_no_further():
    case = _cancelling_case()
    errors = compare_with_oracle(_rounding_again, case)
    assert errors["o"] > testing.TOLERANCES["bfloat16"].output  # beyond the plain bound of max|ref| ...
    check_against_oracle(_rounding_again, case)  # ... but as close as one more rounding allows
    with pytest.raises(AssertionError, match="o: relative error"):
        check_against_oracle(_drops_the_last_value, case)
