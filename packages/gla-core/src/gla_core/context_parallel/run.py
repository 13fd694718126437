"""`dispatch(..., context_axis=...)` and `explain(..., context_axis=...)`: one device's part of a
context-parallel call."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from gla_core.context_parallel.exchange import carry_states
from gla_core.context_parallel.layout import ShardLayout, shard_layout
from gla_core.context_parallel.request import Request, validate_request
from gla_core.context_parallel.transition import augment_for_dense, dense_transition, diagonal_transition
from gla_core.dispatch import resolution_of
from gla_core.dispatch import run as run_shard
from gla_core.resolution import Resolution


def dispatch_context_parallel(
    op: str, arrays: tuple, kwargs: Mapping[str, Any], *, impl: str | None, among: Sequence[str] | None
) -> tuple[jax.Array, jax.Array | None]:
    """This device's slice of o and the final states of the whole sequences (the same on every device).

    The device runs the op on its shard with the implementation dispatch chooses for that call,
    from zero state for the sequences that enter from earlier shards; exchanges the state leaving
    its shard (`gla_core.context_parallel.exchange`); and adds the carried-in state's contribution
    to the entering sequence's outputs (`gla_core.context_parallel.transition`).
    """
    request = validate_request(op, arrays, kwargs)
    args = request.arguments
    q, k, v = args["q"], args["k"], args["v"]
    batch, shard_len = q.shape[:2]
    layout = shard_layout(args["cu_seqlens"], batch, shard_len, request.axis)
    initial_state = _initial_state_here(request, layout)
    if request.dense:
        v, initial_state = augment_for_dense(v, initial_state)
    o, final = run_shard(
        op,
        (q, k, v),
        _shard_keywords(request, layout.local_cu_seqlens, initial_state),
        impl=impl,
        among=among,
        call_fields=request.call_fields,
    )
    if request.dense:
        transition = dense_transition(o, final, args["v"].shape[-1], layout)
    else:
        log_decay = request.cp.log_decay(args)
        transition = diagonal_transition(o, final, q, log_decay, args["scale"], layout)
    carried, chain_end = carry_states(request.axis, layout, transition, request.exchange)
    o = transition.corrected_output(carried)
    if not args["output_final_state"]:
        return o, None
    if chain_end is not None and args["cu_seqlens"] is None:
        return o, chain_end  # fixed length: the last shard's leaving states are the final states
    final_states = transition.final_states(layout, carried)
    return o, jax.lax.psum(jnp.where(layout.ends_here[:, None, None, None], final_states, 0.0), request.axis.name)


def explain_context_parallel(
    op: str, arrays: tuple, kwargs: Mapping[str, Any], *, impl: str | None, among: Sequence[str] | None
) -> Resolution:
    """The resolution of the call each device runs on its shard (arrays may be ShapeDtypeStructs)."""
    request = validate_request(op, arrays, kwargs)
    args = request.arguments
    q, v = args["q"], args["v"]
    num_states = q.shape[0] if args["cu_seqlens"] is None else args["cu_seqlens"].shape[0] - 1
    extra = q.shape[-1] if request.dense else 0
    state_shape = (num_states, v.shape[2], q.shape[-1], v.shape[-1] + extra)
    initial_state = None
    if request.dense or args["initial_state"] is not None:
        initial_state = jax.ShapeDtypeStruct(state_shape, jnp.float32)
    cu = args["cu_seqlens"]
    local_cu = None if cu is None else jax.ShapeDtypeStruct(cu.shape, jnp.int32)
    v = jax.ShapeDtypeStruct((*v.shape[:3], v.shape[-1] + extra), v.dtype)
    return resolution_of(
        op,
        (args["q"], args["k"], v),
        _shard_keywords(request, local_cu, initial_state),
        impl=impl,
        among=among,
        call_fields=request.call_fields,
    )


def _initial_state_here(request: Request, layout: ShardLayout) -> jax.Array | None:
    """[N, HV, K, V] float32: the initial states of the sequences that start on this shard, zero
    for the others (None when there is no initial state and the transition is diagonal)."""
    args = request.arguments
    h0 = args["initial_state"]
    if h0 is None:
        if not request.dense:
            return None
        q, v = args["q"], args["v"]
        num_states = q.shape[0] if layout.local_cu_seqlens is None else layout.local_cu_seqlens.shape[0] - 1
        return jnp.zeros((num_states, v.shape[2], q.shape[-1], v.shape[-1]), jnp.float32)
    return jnp.where(layout.h0_here[:, None, None, None], h0.astype(jnp.float32), 0.0)


def _shard_keywords(request: Request, cu_seqlens: Any, initial_state: Any) -> dict[str, Any]:
    """The keywords of the call on this device's shard: the op's, normalized, with the shard's
    boundaries and initial states, and the final states always requested."""
    args = request.arguments
    keywords = {name: args[name] for name in request.spec.keywords}
    keywords.update(
        initial_state=initial_state, output_final_state=True, cu_seqlens=cu_seqlens, interpret=args["interpret"]
    )
    if "cu_seqlens_cpu" in keywords:  # the host copy describes the global boundaries, not the shard's
        keywords["cu_seqlens_cpu"] = None
    if request.impl_options is not None:
        keywords["impl_options"] = request.impl_options
    return keywords
