"""`dispatch_sharded`: context parallelism on global arrays, with the `jax.shard_map` set up here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gla_core.context_parallel.exchange import DEFAULT_EXCHANGE
from gla_core.dispatch import dispatch
from gla_core.errors import InvalidArgumentError, ShapeError
from gla_core.ops import OpSpec
from gla_core.registry import default_registry
from gla_core.validation import array_shape, bind_arguments


def dispatch_sharded(
    op: str,
    *arrays: Any,
    context_axis: str,
    mesh: Mesh | None = None,
    batch_axis: str | None = None,
    head_axis: str | None = None,
    context_exchange: str = DEFAULT_EXCHANGE,
    impl: str | None = None,
    among: Sequence[str] | None = None,
    **kwargs: Any,
) -> tuple[jax.Array, jax.Array | None]:
    """`dispatch(op, ...)` on global arrays, with T sharded over `context_axis` of `mesh`.

    Builds the `jax.shard_map` (in_specs from the op's `ContextParallelSpec`) and calls
    `dispatch(..., context_axis=context_axis)` inside it. Works eagerly and under `jax.jit`;
    differentiable. The shard_map runs with `check_vma=False` so that Pallas implementations take
    part (their launchers do not declare varying mesh axes yet).

    Args:
      op: "simple_gla", "gla" or "kda".
      *arrays: q, k, v, global: `[B, T, H, K]`, `[B, T, HV, V]`; T divisible by the context
        axis' size, B by the batch axis', H and HV by the head axis'.
      context_axis: the mesh axis T is sharded over.
      mesh: the mesh; default: q's `NamedSharding` mesh, else the mesh set by `jax.set_mesh`.
      batch_axis: a mesh axis to shard B over (data parallelism), or None. Not with `cu_seqlens`
        (packed input has B == 1).
      head_axis: a mesh axis to shard the heads over (H, HV, and head-indexed arrays such as
        g_gamma, A_log, dt_bias), or None. Neither needs any communication.
      context_exchange: "all_gather" or "ring" (`gla_core.context_parallel.exchange`).
      impl, among: as for `dispatch`.
      **kwargs: the op's keyword arguments, global (`cu_seqlens` with global boundaries,
        `initial_state` `[N, HV, K, V]`).

    Returns:
      `(o, final_state)`: o `[B, T, HV, V]` sharded like q; final_state `[N, HV, K, V]` sharded
      over the batch and head axes (replicated over the context axis), or None.

    Example:
      >>> mesh = jax.make_mesh((4,), ("cp",))
      >>> o, ht = dispatch_sharded("simple_gla", q, k, v, g=g, mesh=mesh, context_axis="cp",
      ...                          output_final_state=True)
    """
    spec = default_registry().op(op)
    if spec.context_parallel is None:
        raise InvalidArgumentError(f"context_axis: op {op!r} does not support context parallelism, got {op!r}")
    mesh = _mesh(mesh, arrays[0] if arrays else None)
    _check_axes(mesh, context_axis=context_axis, batch_axis=batch_axis, head_axis=head_axis)
    how = {"impl_options": kwargs.pop("impl_options")} if "impl_options" in kwargs else {}
    bound = bind_arguments(spec, arrays, kwargs)
    _check_divisible(mesh, bound, context_axis, batch_axis, head_axis)
    varlen = bound.get("cu_seqlens") is not None
    names, values, in_specs = [], [], []
    static = {}
    for name, value in bound.items():
        if name in spec.static or not hasattr(value, "shape"):
            static[name] = value
            continue
        if head_axis is not None and name in spec.context_parallel.head_arrays and len(value.shape) != 1:
            raise ShapeError(
                f"{name}: expected a 1-D array (heads first) to shard over head_axis {head_axis!r}, "
                f"got shape {tuple(value.shape)}"
            )
        names.append(name)
        values.append(value)
        in_specs.append(_in_spec(spec, name, len(value.shape), varlen, context_axis, batch_axis, head_axis))
    o_spec = P(batch_axis, context_axis, head_axis, None)
    state_spec = P(None if varlen else batch_axis, head_axis, None, None)
    with_state = bool(bound["output_final_state"])

    def per_device(*shards):
        arguments = {**static, **dict(zip(names, shards, strict=True))}
        q, k, v = (arguments.pop(name) for name in spec.arrays)
        o, final_state = dispatch(
            op,
            q,
            k,
            v,
            context_axis=context_axis,
            context_exchange=context_exchange,
            impl=impl,
            among=among,
            **how,
            **arguments,
        )
        return (o, final_state) if with_state else o

    mapped = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=(o_spec, state_spec) if with_state else o_spec,
        check_vma=False,
    )
    result = mapped(*(_place(x, mesh, s) for x, s in zip(values, in_specs, strict=True)))
    return result if with_state else (result, None)


def _mesh(mesh: Any, q: Any):
    if mesh is not None:
        if not isinstance(mesh, (Mesh, jax.sharding.AbstractMesh)):
            raise InvalidArgumentError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
        return mesh
    sharding = None if isinstance(q, jax.core.Tracer) else getattr(q, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return sharding.mesh
    context = jax.sharding.get_abstract_mesh()
    if not context.empty:
        return context
    raise InvalidArgumentError(
        "mesh: expected a jax.sharding.Mesh (or q with a NamedSharding, or a mesh set with jax.set_mesh), got None"
    )


def _check_axes(mesh, **axes: str | None) -> None:
    seen = {}
    for argument, name in axes.items():
        if name is None:
            continue
        if name not in mesh.axis_names:
            raise InvalidArgumentError(
                f"{argument}: expected one of the mesh axes {tuple(mesh.axis_names)}, got {name!r}"
            )
        if name in seen:
            raise InvalidArgumentError(
                f"{argument}: expected a mesh axis other than {seen[name]}'s, got {name!r} again"
            )
        seen[name] = argument


def _check_divisible(mesh, bound, context_axis, batch_axis, head_axis) -> None:
    q_shape, v_shape = array_shape("q", bound["q"]), array_shape("v", bound["v"])
    if len(q_shape) != 4 or len(v_shape) != 4:
        return  # dispatch names the rank error
    checks = [
        ("q", "T", q_shape[1], context_axis, "context_axis"),
        ("q", "B", q_shape[0], batch_axis, "batch_axis"),
        ("q", "H", q_shape[2], head_axis, "head_axis"),
        ("v", "HV", v_shape[2], head_axis, "head_axis"),
    ]
    for name, dim, size, axis, argument in checks:
        if axis is not None and size % mesh.shape[axis]:
            raise ShapeError(
                f"{name}: expected {dim} divisible by the {mesh.shape[axis]} devices of {argument} {axis!r}, "
                f"got {dim} = {size}"
            )


def _in_spec(spec: OpSpec, name, rank, varlen, context_axis, batch_axis, head_axis) -> P:
    """Where each array argument lives: tokens along T, heads along H, states along B and heads."""
    cp = spec.context_parallel
    if name in (*spec.arrays, *cp.token_arrays):
        return P(batch_axis, context_axis, head_axis, *([None] * (rank - 3)))
    if name in cp.head_arrays:
        return P(head_axis, *([None] * (rank - 1)))
    if name == "initial_state":
        return P(None if varlen else batch_axis, head_axis, None, None)
    return P(*([None] * rank))


def _place(x, mesh, spec: P):
    """x resharded to `spec` when the mesh's axes are explicit (shard_map then requires it)."""
    used = {axis for axis in spec if axis is not None}
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    if used and all(types[axis] == AxisType.Explicit for axis in used):
        return jax.sharding.reshard(x, NamedSharding(mesh, spec) if isinstance(mesh, Mesh) else spec)
    return x
