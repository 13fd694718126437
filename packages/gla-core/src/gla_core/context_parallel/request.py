"""Validation of a context-parallel call: the axis, the arguments of this device's shard and the
global `cu_seqlens`.

How the arrays are sharded cannot be checked (the shard_map runs with check_vma=False): q, k, v and
the op's token arrays must have T sharded over the axis, cu_seqlens, initial_state and the head
arrays must be the same on every device of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from gla_core.backend import backend, interpret_default
from gla_core.context_parallel.axis import ContextAxis, context_axis
from gla_core.context_parallel.exchange import DEFAULT_EXCHANGE, EXCHANGES
from gla_core.errors import InvalidArgumentError
from gla_core.ops import ContextParallelSpec, OpSpec
from gla_core.registry import default_registry
from gla_core.validation import check_cu_seqlens, is_concrete, validate

# Keywords (of some ops) that context parallelism does not serve: the serving path's pool of decode
# states, FLA's V-first state layout, kda's per-chunk states.
_UNSUPPORTED = {
    "ssm_state_indices": "a pool of decode states has no sequence to shard along T",
    "num_accepted_tokens": "a pool of decode states has no sequence to shard along T",
    "state_v_first": "context parallelism carries [N, H, K, V] states; pass K-first states",
    "return_intermediate_states": "a shard's per-chunk states would miss the state carried into it",
}


@dataclasses.dataclass(frozen=True)
class Request:
    """A validated context-parallel call.

    Attributes:
      spec, cp: the op and how its state carries across shards.
      axis: the context axis.
      exchange: "all_gather" or "ring".
      arguments: the op's normalized arguments for this device's shard (`gla_core.validation`),
        except `cu_seqlens`, which holds the global boundaries (int32 [N+1]) or None.
      impl_options: the call's `impl_options`, passed on unchanged.
    """

    spec: OpSpec
    cp: ContextParallelSpec
    axis: ContextAxis
    exchange: str
    arguments: dict[str, Any]
    impl_options: Any

    @property
    def dense(self) -> bool:
        """Whether the op's transition is dense ([K, K], obtained from extra value columns)."""
        return self.cp.log_decay is None

    @property
    def call_fields(self) -> dict[str, Any]:
        """The fields that mark the per-device `Call` as part of a context-parallel call."""
        return {"context_axis": self.axis.name}


def validate_request(op: str, arrays: tuple, kwargs: Mapping[str, Any]) -> Request:
    """Checks a `dispatch(op, *arrays, context_axis=..., **kwargs)` call made inside `jax.shard_map`.

    The arrays are this device's shard: `[B, T, ...]` with T the shard length. Raises
    `gla_core.errors` exceptions naming the argument, the expected and the received value.
    """
    kwargs = dict(kwargs)
    axis_name = kwargs.pop("context_axis")
    exchange = kwargs.pop("context_exchange", None) or DEFAULT_EXCHANGE
    if exchange not in EXCHANGES:
        raise InvalidArgumentError(f"context_exchange: expected one of {EXCHANGES}, got {exchange!r}")
    spec = default_registry().op(op)
    if spec.context_parallel is None:
        supported = [name for name in default_registry().ops() if default_registry().op(name).context_parallel]
        raise InvalidArgumentError(
            f"context_axis: op {op!r} does not support context parallelism (no state carried along T); "
            f"expected one of {supported}, got context_axis={axis_name!r}"
        )
    axis = context_axis(axis_name)
    impl_options = kwargs.pop("impl_options", None)
    cu_seqlens = kwargs.get("cu_seqlens")
    if cu_seqlens is not None and hasattr(cu_seqlens, "shape") and hasattr(cu_seqlens, "dtype"):
        # the shard is validated with the boundaries' structure only; their values are global
        kwargs["cu_seqlens"] = jax.ShapeDtypeStruct(cu_seqlens.shape, cu_seqlens.dtype)
    _, arguments = validate(spec, arrays, kwargs, backend=backend(), interpret=interpret_default())
    for name, reason in _UNSUPPORTED.items():
        value = arguments.get(name)
        if value is not None and value is not False:
            raise InvalidArgumentError(f"{name}: not supported with context_axis ({reason}), got {value!r}")
    if cu_seqlens is not None:
        batch, seq_len = arguments["q"].shape[:2]
        if is_concrete(cu_seqlens):
            check_cu_seqlens(cu_seqlens, batch, seq_len * axis.size)
        if not isinstance(cu_seqlens, jax.ShapeDtypeStruct):  # explain takes structs
            cu_seqlens = jnp.asarray(cu_seqlens).astype(jnp.int32)
    arguments["cu_seqlens"] = cu_seqlens
    return Request(spec, spec.context_parallel, axis, exchange, arguments, impl_options)
