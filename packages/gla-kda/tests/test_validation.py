"""Validation of kda and kda_gate (gla-kda's op specs): one test per bad input, the exception type and
a message naming the argument."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from gla_core.errors import DTypeError, InvalidArgumentError, ShapeError
from gla_core.kit import validate
from gla_kda.ops import KDA, KDA_GATE

B, T, H, K, V = 2, 12, 3, 8, 4


def zeros(*shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


def kda(hv=H, **kwargs):
    arrays = (zeros(B, T, H, K), zeros(B, T, H, K), kwargs.pop("v", zeros(B, T, hv, V)))
    kwargs.setdefault("g", zeros(B, T, hv, K))
    kwargs.setdefault("beta", zeros(B, T, hv))
    return validate(KDA, arrays, kwargs, backend="cpu", interpret=False)


def kda_gate(**kwargs):
    g = kwargs.pop("g", zeros(B, T, H, K))
    kwargs.setdefault("A_log", zeros(H))
    return validate(KDA_GATE, (g,), kwargs, backend="cpu", interpret=False)


def expect(error_type, argument, fn, **kwargs):
    with pytest.raises(error_type) as info:
        fn(**kwargs)
    assert str(info.value).startswith(argument + ":") or f"{argument!r}" in str(info.value), str(info.value)
    return str(info.value)


def test_grouped_value_heads_must_be_a_multiple_of_h():
    expect(ShapeError, "v", kda, hv=H + 1, v=zeros(B, T, H + 1, V), g=zeros(B, T, H + 1, K), beta=zeros(B, T, H + 1))


def test_wrong_kda_gate_and_beta_shapes():
    expect(ShapeError, "g", kda, g=zeros(B, T, H, K + 1))
    expect(ShapeError, "beta", kda, beta=zeros(B, T, H, 1))


def test_wrong_kda_gate_parameter_shapes():
    expect(ShapeError, "A_log", kda, use_gate_in_kernel=True, A_log=zeros(H + 1))
    expect(ShapeError, "dt_bias", kda, use_gate_in_kernel=True, A_log=zeros(H), dt_bias=zeros(H, K))
    expect(ShapeError, "A_log", kda_gate, A_log=zeros(1))


def test_gate_parameters_without_in_kernel_gate_are_rejected():
    message = expect(InvalidArgumentError, "A_log", kda, A_log=zeros(H))
    assert "use_gate_in_kernel" in message


def test_in_kernel_gate_needs_a_log():
    expect(InvalidArgumentError, "A_log", kda, use_gate_in_kernel=True)


@pytest.mark.parametrize("bound", [0.0, 1.0, float("nan"), "low"])
def test_bad_lower_bound(bound):
    expect(InvalidArgumentError, "lower_bound", kda_gate, lower_bound=bound)


# ------------------------------------------------------------------ dtypes


def test_bad_output_dtype_of_kda_gate():
    expect(DTypeError, "output_dtype", kda_gate, output_dtype=jnp.int32)


# ------------------------------------------------------------------ states


def test_kda_initial_state_uses_value_heads():
    kda(hv=2 * H, v=zeros(B, T, 2 * H, V), initial_state=zeros(B, 2 * H, K, V))
    expect(ShapeError, "initial_state", kda, hv=2 * H, v=zeros(B, T, 2 * H, V), initial_state=zeros(B, H, K, V))


def test_non_bool_flag_is_rejected():
    expect(InvalidArgumentError, "use_qk_l2norm_in_kernel", kda, use_qk_l2norm_in_kernel=1)
