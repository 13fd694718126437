"""One test per bad input: the exception type, and a message naming the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_core.attention_ops import GLA, SIMPLE_GLA
from gla_core.errors import DTypeError, InvalidArgumentError, ShapeError, UnknownArgumentError
from gla_core.validation import validate

B, T, H, K, V = 2, 12, 3, 8, 4


def zeros(*shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


def simple_gla(**kwargs):
    q = kwargs.pop("q", zeros(B, T, H, K))
    arrays = (q, kwargs.pop("k", zeros(B, T, H, K)), kwargs.pop("v", zeros(B, T, H, V)))
    return validate(SIMPLE_GLA, arrays, kwargs, backend="cpu", interpret=False)


def packed(**kwargs):
    """simple_gla with B = 1 and T packed tokens."""
    return simple_gla(q=zeros(1, T, H, K), k=zeros(1, T, H, K), v=zeros(1, T, H, V), **kwargs)


def expect(error_type, argument, fn, **kwargs):
    with pytest.raises(error_type) as info:
        fn(**kwargs)
    assert str(info.value).startswith(argument + ":") or f"{argument!r}" in str(info.value), str(info.value)
    return str(info.value)


# ------------------------------------------------------------------ shapes


def test_wrong_rank_of_q():
    message = expect(ShapeError, "q", simple_gla, q=zeros(T, H, K))
    assert "rank 4" in message and str((T, H, K)) in message


def test_mismatched_k():
    message = expect(ShapeError, "k", simple_gla, k=zeros(B, T, H, K + 1))
    assert str((B, T, H, K)) in message and str((B, T, H, K + 1)) in message


@pytest.mark.parametrize("shape", [(B + 1, T, H, V), (B, T - 1, H, V)])
def test_mismatched_batch_or_time_of_v(shape):
    expect(ShapeError, "v", simple_gla, v=zeros(*shape))


def test_mismatched_heads_of_v():
    message = expect(ShapeError, "v", simple_gla, v=zeros(B, T, H + 1, V))
    assert f"H = {H}" in message


def test_wrong_g_shape():
    message = expect(ShapeError, "g", simple_gla, g=zeros(B, T, H, 1))
    assert "[B, T, H]" in message


def test_wrong_g_gamma_shape():
    expect(ShapeError, "g_gamma", simple_gla, g_gamma=zeros(B, H))


def test_wrong_gk_shape():
    arrays = (zeros(B, T, H, K), zeros(B, T, H, K), zeros(B, T, H, V))
    with pytest.raises(ShapeError, match=r"^gk:"):
        validate(GLA, arrays, {"gk": zeros(B, T, H)}, backend="cpu", interpret=False)


def test_gla_accepts_fla_chunk_gla_name_g_for_gk():
    arrays = (zeros(B, T, H, K), zeros(B, T, H, K), zeros(B, T, H, V))
    call, args = validate(GLA, arrays, {"g": zeros(B, T, H, K)}, backend="cpu", interpret=False)
    assert call.gates == {"gk"} and args["gk"] is not None


def test_gla_without_gk_is_rejected():
    arrays = (zeros(B, T, H, K), zeros(B, T, H, K), zeros(B, T, H, V))
    with pytest.raises(InvalidArgumentError, match=r"^gk:"):
        validate(GLA, arrays, {}, backend="cpu", interpret=False)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_integer_inputs_are_rejected(name):
    shape = (B, T, H, V if name == "v" else K)
    message = expect(DTypeError, name, simple_gla, **{name: zeros(*shape, dtype=jnp.int32)})
    assert "int32" in message


def test_mixed_dtypes_of_q_and_v_are_rejected():
    message = expect(DTypeError, "v", simple_gla, v=zeros(B, T, H, V, dtype=jnp.bfloat16))
    assert "bfloat16" in message and "float32" in message


def test_integer_gate_is_rejected():
    expect(DTypeError, "g", simple_gla, g=zeros(B, T, H, dtype=jnp.int32))


def test_non_array_is_rejected():
    expect(DTypeError, "q", simple_gla, q=[[1.0]])


def test_initial_state_wrong_shape():
    message = expect(ShapeError, "initial_state", simple_gla, initial_state=zeros(B, H, V, K))
    assert "[N, H, K, V]" in message and str((B, H, K, V)) in message


def test_initial_state_must_have_one_state_per_sequence():
    cu_seqlens = jnp.array([0, 5, T])
    message = expect(ShapeError, "initial_state", packed, cu_seqlens=cu_seqlens, initial_state=zeros(1, H, K, V))
    assert str((2, H, K, V)) in message


def test_integer_initial_state_is_rejected():
    expect(DTypeError, "initial_state", simple_gla, initial_state=zeros(B, H, K, V, dtype=jnp.int32))


# ------------------------------------------------------------------ cu_seqlens


def test_cu_seqlens_must_be_1d():
    expect(ShapeError, "cu_seqlens", packed, cu_seqlens=jnp.array([[0, T]]))


def test_cu_seqlens_must_be_integer():
    message = expect(DTypeError, "cu_seqlens", packed, cu_seqlens=jnp.array([0.0, T]))
    assert "float32" in message


def test_cu_seqlens_must_start_at_zero():
    message = expect(InvalidArgumentError, "cu_seqlens", packed, cu_seqlens=jnp.array([1, T]))
    assert "first value 0, got 1" in message


def test_cu_seqlens_must_end_at_t():
    message = expect(InvalidArgumentError, "cu_seqlens", packed, cu_seqlens=jnp.array([0, T - 1]))
    assert f"T = {T}, got {T - 1}" in message


def test_cu_seqlens_must_not_decrease():
    message = expect(InvalidArgumentError, "cu_seqlens", packed, cu_seqlens=jnp.array([0, 8, 4, T]))
    assert "8 then 4" in message


def test_cu_seqlens_needs_batch_one():
    message = expect(ShapeError, "cu_seqlens", simple_gla, cu_seqlens=jnp.array([0, T]))
    assert f"B = {B}" in message


def test_cu_seqlens_int64_numpy_is_accepted_as_int32():
    call, args = packed(cu_seqlens=np.array([0, 0, 1, T], dtype=np.int64))
    assert call.num_sequences == 3 and args["cu_seqlens"].dtype == jnp.int32


def test_traced_cu_seqlens_skips_value_checks_only():
    @jax.jit
    def run(cu):
        return packed(cu_seqlens=cu)[1]["cu_seqlens"]

    assert run(jnp.array([0, 5, T])).dtype == jnp.int32


# ------------------------------------------------------------------ scalars and keywords


@pytest.mark.parametrize("chunk_size", [0, 48, 256, 64.0, "64", True])
def test_bad_chunk_size(chunk_size):
    expect(InvalidArgumentError, "chunk_size", simple_gla, chunk_size=chunk_size)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan"), "0.1", True])
def test_bad_scale(scale):
    expect(InvalidArgumentError, "scale", simple_gla, scale=scale)


def test_default_scale_is_inverse_sqrt_k():
    _, args = simple_gla()
    assert args["scale"] == pytest.approx(K**-0.5)


def test_unknown_keyword_is_rejected():
    message = expect(UnknownArgumentError, "gate", simple_gla, gate=zeros(B, T, H))
    assert "simple_gla" in message


def test_argument_given_twice_is_rejected():
    arrays = (zeros(B, T, H, K), zeros(B, T, H, K), zeros(B, T, H, V))
    with pytest.raises(UnknownArgumentError, match="'q' given more than once"):
        validate(SIMPLE_GLA, arrays, {"q": arrays[0]}, backend="cpu", interpret=False)


def test_too_many_positional_arrays_are_rejected():
    arrays = (zeros(B, T, H, K),) * 4
    with pytest.raises(UnknownArgumentError, match="at most 3 positional"):
        validate(SIMPLE_GLA, arrays, {}, backend="cpu", interpret=False)


def test_valid_call_is_described():
    call, _ = simple_gla(g=zeros(B, T, H), g_gamma=zeros(H), output_final_state=True)
    assert call.gates == {"g", "g_gamma"}
    assert "gates=g+g_gamma" in call.describe() and "ht" in call.describe()


def test_non_bool_flag_is_rejected():
    expect(InvalidArgumentError, "output_final_state", simple_gla, output_final_state="yes")
