"""`explain(..., context_axis=...)` describes the call each device runs: its shard, its final states
always requested, the extra value columns of a dense transition, and which implementations take part
or decline with their reason."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import gla_core

from . import checks


def _explain(op, sharded, **replicated):
    """`gla_core.explain(op, ..., context_axis="cp")` traced inside a shard_map over "cp4"
    (check_vma=False): the arrays of `sharded` (q, k, v first) have T sharded, `replicated` are
    closed over."""
    found = []
    names = list(sharded)

    def body(*shards):
        arrays = dict(zip(names, shards, strict=True))
        q, k, v = arrays.pop("q"), arrays.pop("k"), arrays.pop("v")
        found.append(gla_core.explain(op, q, k, v, context_axis="cp", **arrays, **replicated))
        return q

    specs = (P(None, "cp"),) * len(names)
    mesh = checks.mesh("cp4", explicit=False)
    jax.eval_shape(
        jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(None, "cp"), check_vma=False), *sharded.values()
    )
    return found[0]


def test_the_per_device_call():
    q = jnp.ones((2, checks.SEQ_LEN, 2, 16))
    resolution = _explain("simple_gla", dict(q=q, k=q, v=q, g=q[..., 0]), interpret=True)
    call = resolution.call
    assert (call.seq_len, call.context_axis) == (checks.SEQ_LEN // 4, "cp")
    assert call.output_final_state and not call.has_initial_state  # a diagonal transition needs no h0 column
    assert "context_axis=cp" in str(resolution)
    assert resolution.winner.name == "fused_chunk", str(resolution)  # the highest priority takes part


def test_packed_shards_and_who_declines():
    q = jnp.ones((1, checks.SEQ_LEN, 2, 16))
    cu = jnp.asarray(checks.CU_SEQLENS, jnp.int32)
    resolution = _explain("simple_gla", dict(q=q, k=q, v=q, g=q[..., 0]), cu_seqlens=cu, interpret=True)
    assert resolution.call.num_sequences == len(checks.CU_SEQLENS) - 1
    reasons = {c.implementation.name: c.reason for c in resolution.candidates}
    assert reasons["fused_chunk"] is None and reasons["chunk"] is None, reasons  # both take packed sequences
    assert resolution.winner.name == "fused_chunk", str(resolution)


def test_dense_transition_adds_key_columns():
    q = jnp.ones((1, checks.SEQ_LEN, 2, 16))
    v = jnp.ones((1, checks.SEQ_LEN, 4, 8))
    g = jnp.full((1, checks.SEQ_LEN, 4, 16), -0.1)
    beta = jnp.full((1, checks.SEQ_LEN, 4), 0.5)
    resolution = _explain("kda", dict(q=q, k=q, v=v, g=g, beta=beta))
    assert (resolution.call.value_dim, resolution.call.has_initial_state) == (8 + 16, True)
    assert resolution.winner.name == "xla", str(resolution)
