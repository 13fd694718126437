"""The context axis of a context-parallel call, checked against the enclosing `jax.shard_map`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from gla_core.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class ContextAxis:
    """The mesh axis T is sharded over, seen from inside `jax.shard_map`.

    Attributes:
      name: the axis name.
      size: P, the number of shards (devices) along it.
      index: this device's position along it, a traced int32 scalar in [0, P).
    """

    name: str
    size: int
    index: jax.Array


def context_axis(name: Any) -> ContextAxis:
    """The axis `name` of the enclosing `jax.shard_map`.

    Raises `InvalidArgumentError` naming `context_axis` when `name` is not a string, when the call
    is outside any shard_map, when the mesh has no manual axis of that name, or when the shard_map
    checks varying mesh axes (`check_vma=True`, JAX's default): the implementations' scans and
    Pallas kernels do not declare how their values vary over mesh axes, which that mode requires.
    """
    if not isinstance(name, str):
        raise InvalidArgumentError(
            f"context_axis: expected the name (a str) of the mesh axis T is sharded over, got {name!r}"
        )
    mesh = jax.sharding.get_abstract_mesh()
    manual = tuple(mesh.manual_axes) if not mesh.empty else ()
    if name not in manual:
        if not manual:
            raise InvalidArgumentError(
                f"context_axis: expected the call inside a jax.shard_map whose mesh has axis {name!r} with T "
                "sharded over it, got a call outside any shard_map "
                "(gla_core.dispatch_sharded sets one up for global arrays)"
            )
        if name not in mesh.axis_names:
            raise InvalidArgumentError(
                f"context_axis: expected one of the axes {tuple(mesh.axis_names)} of the enclosing "
                f"jax.shard_map's mesh, got {name!r}"
            )
        raise InvalidArgumentError(
            f"context_axis: expected a manual axis of the enclosing jax.shard_map {manual}, got {name!r}, "
            "which that shard_map leaves to the compiler (its axis_names)"
        )
    index = jax.lax.axis_index(name)
    if name in jax.typeof(index).manual_axis_type.varying:  # only a checking shard_map types the index so
        raise InvalidArgumentError(
            f"context_axis: expected a jax.shard_map with check_vma=False around the call, got one with "
            f"check_vma=True (JAX's default) over {name!r}: the implementations' scans and Pallas kernels do "
            "not declare how their values vary over mesh axes, which check_vma=True requires "
            "(gla_core.dispatch_sharded sets up the shard_map with check_vma=False)"
        )
    return ContextAxis(name=name, size=int(mesh.shape[name]), index=index)
