"""`fused_chunk_simple_gla`: which implementation it picks, and its results against the oracle."""

from __future__ import annotations

import jax
import pytest

import gla_core
import gla_fused
from gla_fused.functions import FAMILY
from gla_ref import testing

pytestmark = pytest.mark.oracle


def _structs(case):
    return {n: jax.ShapeDtypeStruct(x.shape, x.dtype) for n, x in case.inputs.items()}


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (dict(gates=("g_gamma",)), "fused_chunk"),
        (dict(gates=("g",)), "fused_chunk"),
        (dict(gates=("g", "g_gamma")), "fused_chunk"),
        (dict(gates=("g_gamma",), num_heads=1, cu_seqlens=[0, 30, 100]), "fused_chunk"),
    ],
    ids=["g_gamma", "g", "g+g_gamma", "varlen"],
)
def test_family_order_on_tpu(options, expected):
    case = testing.make_case("simple_gla", seq_len=100, initial_state=True, output_final_state=True, **options)
    with gla_core.use(backend="tpu"):
        assert gla_core.explain("simple_gla", **_structs(case), **case.options, among=FAMILY).winner.name == expected


def test_off_tpu_without_interpret_it_uses_xla():
    case = testing.make_case("simple_gla", gates=("g_gamma",), seq_len=100)
    assert gla_core.explain("simple_gla", **_structs(case), **case.options, among=FAMILY).winner.name == "xla"


def test_against_oracle_on_cpu():
    case = testing.make_case(
        "simple_gla", gates=("g", "g_gamma"), seq_len=70, chunk_size=16, initial_state=True, output_final_state=True
    )
    testing.check_against_oracle(gla_fused.fused_chunk_simple_gla, case)
