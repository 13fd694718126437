"""Bad input to context parallelism: `gla_core.errors` exceptions naming the argument, what was
expected and what was received. Every error is raised while tracing, before anything compiles."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gla_core
from gla_core.errors import InvalidArgumentError, ShapeError

from . import checks


def _simple(batch=1, seq_len=checks.SEQ_LEN, heads=2, dim=16):
    q = jnp.ones((batch, seq_len, heads, dim))
    return q, q, q, jnp.full((batch, seq_len, heads), -0.1)


def _in_shard_map(body, check_vma=False):
    """Traces `body(q, k, v, g)` inside a shard_map over mesh "cp4", T sharded (nothing is compiled)."""
    mesh = checks.mesh("cp4", explicit=False)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "cp"),) * 4, out_specs=P(), check_vma=check_vma)
    return jax.eval_shape(mapped, *_simple())


def _raises(kind, *fragments):
    return pytest.raises(kind, match=".*".join(re.escape(f) for f in fragments))


def test_outside_shard_map():
    q, k, v, g = _simple()
    with _raises(InvalidArgumentError, "context_axis:", "inside a jax.shard_map", "'cp'", "outside any shard_map"):
        gla_core.dispatch("simple_gla", q, k, v, g=g, context_axis="cp")


def test_axis_not_in_the_mesh():
    body = lambda q, k, v, g: gla_core.dispatch("simple_gla", q, k, v, g=g, context_axis="sp")[0].sum()
    with _raises(InvalidArgumentError, "context_axis:", "expected one of the axes ('cp',)", "got 'sp'"):
        _in_shard_map(body)


def test_axis_not_a_name():
    body = lambda q, k, v, g: gla_core.dispatch("simple_gla", q, k, v, g=g, context_axis=0)[0].sum()
    with _raises(InvalidArgumentError, "context_axis:", "expected the name (a str)", "got 0"):
        _in_shard_map(body)


def test_checked_shard_map():
    body = lambda q, k, v, g: jax.lax.psum(gla_core.dispatch("simple_gla", q, k, v, g=g, context_axis="cp")[0], "cp")
    with _raises(InvalidArgumentError, "context_axis:", "expected a jax.shard_map with check_vma=False", "got one"):
        _in_shard_map(lambda *a: body(*a).sum(), check_vma=True)


def test_unknown_exchange():
    body = lambda q, k, v, g: gla_core.dispatch("simple_gla", q, k, v, g=g, context_axis="cp", context_exchange="tree")[
        0
    ].sum()
    with _raises(InvalidArgumentError, "context_exchange:", "expected one of ('all_gather', 'ring')", "got 'tree'"):
        _in_shard_map(body)


def test_exchange_without_axis():
    q, k, v, g = _simple()
    with _raises(InvalidArgumentError, "context_exchange:", "only used with context_axis", "got context_exchange="):
        gla_core.dispatch("simple_gla", q, k, v, g=g, context_exchange="ring")


def test_op_without_state():
    g = jnp.ones((1, checks.SEQ_LEN, 2, 16))
    with _raises(InvalidArgumentError, "context_axis:", "op 'kda_gate'", "expected one of", "got context_axis="):
        gla_core.dispatch("kda_gate", g, A_log=jnp.zeros(2), context_axis="cp")


def test_global_boundaries_checked_against_the_global_length():
    cu = np.array([0, 40, 90], np.int32)  # global T is 96: 4 shards of 24

    def body(q, k, v, g):
        return gla_core.dispatch("simple_gla", q, k, v, g=g, cu_seqlens=cu, context_axis="cp")[0].sum()

    with _raises(InvalidArgumentError, "cu_seqlens:", "expected last value T = 96", "got 90"):
        _in_shard_map(body)


def test_shard_shapes_validated_like_any_call():
    def body(q, k, v, g):
        state = jnp.zeros((1, 2, 16, 8))
        return gla_core.dispatch("simple_gla", q, k, v, g=g, initial_state=state, context_axis="cp")[0].sum()

    with _raises(ShapeError, "initial_state:", "expected shape", "(1, 2, 16, 16)", "got (1, 2, 16, 8)"):
        _in_shard_map(body)


@pytest.mark.parametrize(
    ("shape", "axes", "fragments"),
    [
        ((1, 90, 2, 16), {}, ("q:", "expected T divisible by the 4 devices of context_axis 'cp'", "got T = 90")),
        ((3, 96, 2, 16), {"batch_axis": "dp"}, ("q:", "expected B divisible by the 2 devices of batch_axis", "B = 3")),
        ((1, 96, 3, 16), {"head_axis": "hp"}, ("q:", "expected H divisible by the 2 devices of head_axis", "H = 3")),
    ],
)
def test_sharded_shapes_must_divide(shape, axes, fragments):
    q = jnp.ones(shape)
    mesh_name = {"batch_axis": "dp2xcp4", "head_axis": "cp4xhp2"}.get(next(iter(axes), None), "cp4")
    with _raises(ShapeError, *fragments):
        gla_core.dispatch_sharded(
            "simple_gla", q, q, q, g=q[..., 0], mesh=checks.mesh(mesh_name), context_axis="cp", **axes
        )


def test_sharded_axis_names():
    q, k, v, g = _simple()
    mesh = checks.mesh("dp2xcp4")
    with _raises(InvalidArgumentError, "context_axis:", "expected one of the mesh axes ('dp', 'cp')", "got 'sp'"):
        gla_core.dispatch_sharded("simple_gla", q, k, v, g=g, mesh=mesh, context_axis="sp")
    with _raises(InvalidArgumentError, "batch_axis:", "expected a mesh axis other than context_axis's", "got 'cp'"):
        gla_core.dispatch_sharded("simple_gla", q, k, v, g=g, mesh=mesh, context_axis="cp", batch_axis="cp")


def test_sharded_needs_a_mesh():
    q, k, v, g = _simple()
    with _raises(InvalidArgumentError, "mesh:", "expected a jax.sharding.Mesh", "got None"):
        gla_core.dispatch_sharded("simple_gla", q, k, v, g=g, context_axis="cp")
