"""The FLA-named functions take FLA's arguments with FLA's names, order and defaults.

`FLA_SIGNATURES` is FLA's public signatures, read from fla-org/flash-linear-attention at commit
bc3b101dcb713ddc5bd8924b66754eb68b5ccf89 (fla/ops/simple_gla, fla/ops/gla, fla/ops/kda): every
positional-or-keyword parameter in order with its default, and the names FLA reads from `**kwargs`.
Ours must start with exactly those parameters (gla's extras come after them, keyword-only, and there
is no `**kwargs`: an unknown name is an error, never ignored), and accept the `**kwargs` names as
keywords. Where a default is a torch object, `EQUIVALENT_DEFAULTS` says what stands for it.
"""

from __future__ import annotations

import inspect
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
import gla_fused
import gla_kda
import gla_simple

REQUIRED = inspect.Parameter.empty
FLA_COMMIT = "bc3b101dcb713ddc5bd8924b66754eb68b5ccf89"

# function: ((parameter, default), ...), names FLA reads from **kwargs (None: no **kwargs)
FLA_SIGNATURES = {
    "chunk_simple_gla": (
        (
            ("q", REQUIRED),
            ("k", REQUIRED),
            ("v", REQUIRED),
            ("g", None),
            ("g_gamma", None),
            ("scale", None),
            ("initial_state", None),
            ("output_final_state", False),
            ("state_v_first", False),
            ("cu_seqlens", None),
            ("cu_seqlens_cpu", None),
        ),
        ("transpose_state_layout", "chunk_size"),
    ),
    "chunk_gla": (
        (
            ("q", REQUIRED),
            ("k", REQUIRED),
            ("v", REQUIRED),
            ("g", REQUIRED),
            ("scale", None),
            ("initial_state", None),
            ("output_final_state", False),
            ("state_v_first", False),
            ("cu_seqlens", None),
            ("cu_seqlens_cpu", None),
        ),
        None,
    ),
    "fused_recurrent_simple_gla": (
        (
            ("q", REQUIRED),
            ("k", REQUIRED),
            ("v", REQUIRED),
            ("g", None),
            ("g_gamma", None),
            ("scale", None),
            ("initial_state", None),
            ("output_final_state", False),
            ("reverse", False),
            ("state_v_first", False),
            ("cu_seqlens", None),
        ),
        ("transpose_state_layout",),
    ),
    "fused_recurrent_gla": (
        (
            ("q", REQUIRED),
            ("k", REQUIRED),
            ("v", REQUIRED),
            ("gk", None),
            ("gv", None),
            ("scale", None),
            ("initial_state", None),
            ("output_final_state", False),
            ("reverse", False),
            ("state_v_first", False),
            ("cu_seqlens", None),
        ),
        ("transpose_state_layout",),
    ),
    "fused_chunk_simple_gla": (
        (
            ("q", REQUIRED),
            ("k", REQUIRED),
            ("v", REQUIRED),
            ("g", None),
            ("g_gamma", None),
            ("scale", None),
            ("initial_state", None),
            ("output_final_state", False),
            ("cu_seqlens", None),
        ),
        None,
    ),
    "parallel_simple_gla": (
        (
            ("q", REQUIRED),
            ("k", REQUIRED),
            ("v", REQUIRED),
            ("g", None),
            ("scale", None),
            ("output_attentions", False),
            ("cu_seqlens", None),
            ("cu_seqlens_cpu", None),
        ),
        (),  # FLA's **kwargs only rejects the removed head_first
    ),
    "chunk_kda": (
        (
            ("q", REQUIRED),
            ("k", REQUIRED),
            ("v", REQUIRED),
            ("g", REQUIRED),
            ("beta", REQUIRED),
            ("scale", None),
            ("initial_state", None),
            ("output_final_state", False),
            ("use_qk_l2norm_in_kernel", False),
            ("use_gate_in_kernel", False),
            ("use_beta_sigmoid_in_kernel", False),
            ("allow_neg_eigval", False),
            ("safe_gate", False),
            ("lower_bound", None),
            ("disable_recompute", False),
            ("return_intermediate_states", False),
            ("state_v_first", False),
            ("cu_seqlens", None),
            ("cu_seqlens_cpu", None),
            ("cp_context", None),
        ),
        ("transpose_state_layout", "A_log", "dt_bias", "chunk_size"),
    ),
    "fused_recurrent_kda": (
        (
            ("q", REQUIRED),
            ("k", REQUIRED),
            ("v", REQUIRED),
            ("g", REQUIRED),
            ("beta", REQUIRED),
            ("A_log", None),
            ("dt_bias", None),
            ("scale", None),
            ("initial_state", None),
            ("output_final_state", False),
            ("use_qk_l2norm_in_kernel", False),
            ("use_gate_in_kernel", False),
            ("use_beta_sigmoid_in_kernel", False),
            ("allow_neg_eigval", False),
            ("lower_bound", None),
            ("state_v_first", False),
            ("cu_seqlens", None),
        ),
        ("transpose_state_layout",),
    ),
    "fused_kda_gate": (
        (("g", REQUIRED), ("A_log", None), ("dt_bias", None), ("lower_bound", None), ("output_dtype", "float32")),
        None,
    ),
}

# FLA's torch default -> ours, and why.
EQUIVALENT_DEFAULTS = {
    ("fused_kda_gate", "output_dtype"): (
        None,
        "torch.float32 in FLA; gla's None means float32 too, except float64 for float64 g (float64 is not rounded)",
    ),
}

FUNCTIONS = {
    "chunk_simple_gla": gla_simple.chunk_simple_gla,
    "chunk_gla": gla_simple.chunk_gla,
    "fused_recurrent_simple_gla": gla_simple.fused_recurrent_simple_gla,
    "fused_recurrent_gla": gla_simple.fused_recurrent_gla,
    "parallel_simple_gla": gla_simple.parallel_simple_gla,
    "fused_chunk_simple_gla": gla_fused.fused_chunk_simple_gla,
    "chunk_kda": gla_kda.chunk_kda,
    "fused_recurrent_kda": gla_kda.fused_recurrent_kda,
    "fused_kda_gate": gla_kda.fused_kda_gate,
}


@pytest.mark.parametrize("name", sorted(FLA_SIGNATURES))
def test_signature_matches_fla(name):
    fla_parameters, fla_kwargs = FLA_SIGNATURES[name]
    ours = inspect.signature(FUNCTIONS[name]).parameters
    positional = [p for p in ours.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional] == [p for p, _ in fla_parameters], f"{name}: names or order differ from FLA"
    for parameter, (fla_name, fla_default) in zip(positional, fla_parameters, strict=True):
        expected = EQUIVALENT_DEFAULTS.get((name, fla_name), (fla_default,))[0]
        assert parameter.default == expected or (parameter.default is expected), (
            f"{name}({fla_name}=...): default {parameter.default!r}, FLA's {fla_default!r}"
        )
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ours.values()), f"{name}: no **kwargs"
    extras = [p for p in ours.values() if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extras), f"{name}: extras are keyword-only"
    for kwarg in fla_kwargs or ():
        assert kwarg in ours, f"{name}: FLA reads {kwarg!r} from **kwargs; gla takes it by keyword"


def _simple_inputs(batch=1, seq_len=12, heads=2, dim=8):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((batch, seq_len, heads, dim)), jnp.float32) for _ in range(3))
    g = jnp.asarray(-np.abs(rng.standard_normal((batch, seq_len, heads))), jnp.float32)
    return q, k, v, g


def test_transpose_state_layout_is_the_deprecated_state_v_first():
    q, k, v, g = _simple_inputs()
    h0 = jnp.arange(2 * 8 * 8, dtype=jnp.float32).reshape(1, 2, 8, 8) / 100
    _, expected = gla_simple.chunk_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True, state_v_first=True)
    with pytest.warns(DeprecationWarning, match="state_v_first"):
        _, old = gla_simple.chunk_simple_gla(
            q, k, v, g, initial_state=h0, output_final_state=True, transpose_state_layout=True
        )
    np.testing.assert_array_equal(np.asarray(old), np.asarray(expected))
    with pytest.raises(gla_core.errors.InvalidArgumentError, match="transpose_state_layout"):
        gla_simple.fused_recurrent_simple_gla(q, k, v, g, state_v_first=True, transpose_state_layout=True)


def test_arguments_without_a_jax_meaning_are_rejected_by_name():
    q, k, v, g = _simple_inputs()
    errors = gla_core.errors
    with pytest.raises(errors.InvalidArgumentError, match="cp_context"):
        gla_kda.chunk_kda(q, k, v, g[..., None].repeat(8, -1), g, cp_context=object())
    with pytest.raises(errors.InvalidArgumentError, match="gv"):
        gla_simple.fused_recurrent_gla(q, k, v, gk=g[..., None].repeat(8, -1), gv=v)
    with pytest.raises(TypeError, match="head_first"):
        gla_simple.parallel_simple_gla(q, k, v, g, head_first=False)
    with pytest.raises(errors.InvalidArgumentError, match="cu_seqlens_cpu"):  # a host copy that disagrees
        gla_simple.chunk_simple_gla(
            q, k, v, g, cu_seqlens=jnp.asarray([0, 5, 12], jnp.int32), cu_seqlens_cpu=np.asarray([0, 6, 12])
        )
    with pytest.raises(errors.InvalidArgumentError, match="cu_seqlens_cpu"):  # a copy of nothing
        gla_simple.chunk_gla(q, k, v, g[..., None].repeat(8, -1), cu_seqlens_cpu=[0, 12])
    with warnings.catch_warnings():  # the right copy is accepted silently
        warnings.simplefilter("error")
        gla_simple.chunk_simple_gla(
            q, k, v, g, cu_seqlens=jnp.asarray([0, 5, 12], jnp.int32), cu_seqlens_cpu=np.asarray([0, 5, 12])
        )
