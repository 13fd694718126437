"""Context parallelism against the single-device run and the float64 oracle: outputs, final states and
every gradient. Every op (simple_gla with g, g_gamma or both; gla; kda with grouped value heads and with
its in-kernel gate, norms and beta sigmoid), fixed-length and packed, with and without h0/ht, float32
and (kda) bfloat16, on meshes
of 2, 4 and 8 devices along T, 2 x 4 with B sharded and 4 x 2 with the heads sharded; both exchanges;
the implementations that run on CPU (xla, recurrent, reference) and the Pallas chunk kernels in TPU
interpret mode. Each op meets each mesh size at least once; compiles dominate the time, so the cases
are spread over the meshes instead of crossed with them."""

from __future__ import annotations

import pytest

from . import checks

pytestmark = pytest.mark.oracle


def _param(case_name, mesh_name, impl="xla", exchange="all_gather"):
    return pytest.param(case_name, mesh_name, impl, exchange, id=f"{case_name}-{mesh_name}-{impl}-{exchange}")


# through gla_core.dispatch_sharded (global arrays, explicit mesh axes)
SHARDED = [
    _param("simple_gla-g", "cp2"),
    _param("simple_gla-packed", "cp8"),
    _param("simple_gla-packed", "cp4", exchange="ring"),
    _param("simple_gla-packed", "cp4", impl="recurrent"),
    _param("gla", "cp8"),
    _param("gla", "cp2", impl="reference"),
    _param("gla-packed", "cp4"),
    _param("kda-grouped", "cp2"),
    _param("kda-packed", "cp8"),
    _param("kda-packed", "cp4", exchange="ring"),
    _param("kda-no-state", "cp4", impl="recurrent"),
    _param("kda-bf16", "cp4"),
]


@pytest.mark.parametrize(("case_name", "mesh_name", "impl", "exchange"), SHARDED)
def test_dispatch_sharded(case_name, mesh_name, impl, exchange):
    op = checks.case(case_name).op
    fn = checks.sharded(op, mesh_name, impl, exchange=exchange)
    checks.check(case_name, impl, fn, f"dispatch_sharded {mesh_name} {impl} {exchange}")


@pytest.mark.parametrize(
    ("case_name", "exchange"), [("simple_gla-g", "all_gather"), ("gla", "all_gather"), ("kda-grouped", "ring")]
)
def test_data_parallel_2x4(case_name, exchange):
    """`dispatch(..., context_axis="cp")` in the test's own shard_map: B over "dp" (2), T over "cp" (4);
    the batch rows never communicate."""
    op = checks.case(case_name).op
    fn = checks.in_shard_map(op, "dp2xcp4", "xla", exchange=exchange, batch_axis="dp")
    checks.check(case_name, "xla", fn, f"shard_map dp2 x cp4 {exchange}")


@pytest.mark.parametrize("case_name", ["simple_gla-g_gamma", "kda-grouped"])
def test_heads_sharded_4x2(case_name):
    """T over "cp" (4), H and HV (and g_gamma) over "hp" (2)."""
    op = checks.case(case_name).op
    fn = checks.sharded(op, "cp4xhp2", "xla", head_axis="hp")
    checks.check(case_name, "xla", fn, "dispatch_sharded cp4 x hp2")


@pytest.mark.interpret
def test_pallas_chunk_in_interpret_mode():
    """The Pallas chunk kernels of simple_gla (fixed length, h0/ht) take part through their
    initial_state/final-state interface, here in TPU interpret mode on 2 devices."""
    fn = checks.sharded("simple_gla", "cp2", "chunk", interpret=True)
    checks.check("simple_gla-small", "chunk", fn, "dispatch_sharded cp2 chunk (interpret)", interpret=True)
