"""JAX transformations through Pallas TPU implementations: `jax.vmap` by folding, and first-order-only autodiff.

Two guards, independent of any op, for implementations built as a `jax.custom_vjp` whose
forward and backward launch Pallas kernels:

`fold_vmap(fn, args, in_axes=..., out_axes=...)` — calls `fn(*args)` (typically one
`pl.pallas_call` launch) so that under `jax.vmap` the mapped axis is folded into an axis the
kernel already treats independently (its batch axis), instead of going through Pallas' own
batching rule, which adds a grid dimension that TPU interpret mode cannot run. Under vmap:

  - an argument with a fold axis `a` (an int) has the mapped axis merged into axis `a`
    (mapped element i, row r -> row `i * size + r`; free when `a` is 0), an unmapped one is
    broadcast first (one copy per mapped element);
  - every output leaf is split back along its `out_axes` entry;
  - an argument with fold axis None is shared by every row (e.g. a per-head parameter, or
    per-chunk metadata); when it is mapped itself the call cannot be folded and runs once
    per mapped element (`jax.lax.map`, sequential but exact);
  - a zero-size mapped axis gives empty outputs without launching the kernel.
  Folding is exact only if `fn` treats rows along the fold axes independently and in the same
  order for inputs and outputs (row r of every folded input produces row r of every output,
  where an output with `m` rows per input row uses rows `r * m ... r * m + m - 1`), which is
  the case for kernels whose grid walks that axis and whose index maps address it directly.
  Nested vmaps fold again. Without vmap the call is `fn(*args)`; lowering and `jax.export`
  are unchanged apart from the folded shapes.

`first_order_only(fn, implementation=..., op=...)` — `fn` unchanged, but differentiating it
raises `HigherOrderDerivativeError` naming the implementation and the alternative. Wrap the
forward and the backward of the custom VJP with it: a first-order `jax.grad` calls both on
plain values and never differentiates them (no cost), while `jax.grad(jax.grad(...))`,
`jax.hessian` or `jax.jvp` of a VJP differentiate them and would otherwise fail deep inside
Pallas with an empty `NotImplementedError` or `AssertionError`.

Usage (a kernel launcher, and a custom-VJP op):

    def chunk_fwd_h(k, v, gate, h0, meta, *, specs, ...):
        launch = functools.partial(_launch_fwd_h, specs=specs, ...)   # builds and runs pallas_call
        # k, v, gate: [B, ...] fold into B; h0 [N, ...] into N; metadata [NT] shared
        return fold_vmap(launch, (k, v, gate, h0, meta.first), in_axes=(0, 0, 0, 0, None), out_axes=0)

    _forward = first_order_only(_forward, implementation="chunk", op="simple_gla/gla", nondiff_argnums=(0,))
    _backward = first_order_only(_backward, implementation="chunk", op="simple_gla/gla", nondiff_argnums=(0,))
    _op.defvjp(_forward, _backward)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from gla_core.errors import HigherOrderDerivativeError

HIGHER_ORDER_ALTERNATIVE = "impl='xla' (CPU/GPU)"


def first_order_only(
    fn: Callable,
    *,
    implementation: str,
    op: str,
    alternative: str = HIGHER_ORDER_ALTERNATIVE,
    nondiff_argnums: tuple[int, ...] = (),
) -> Callable:
    """`fn` (positional arguments only), raising `HigherOrderDerivativeError` when differentiated.

    Args:
      fn: a function of arrays (pytrees allowed; None for absent arguments).
      implementation: the implementation's registered name, for the message.
      op: the op(s) it implements, for the message.
      alternative: what to use instead for higher-order derivatives.
      nondiff_argnums: positions of hashable static arguments (e.g. a config).
    """
    guarded = jax.custom_jvp(fn, nondiff_argnums=nondiff_argnums)

    def refuse(*_):
        raise HigherOrderDerivativeError(
            f"{op} impl={implementation!r}: higher-order derivatives are not supported (its first-order "
            "backward is hand-written Pallas TPU kernels, which cannot be differentiated again; this happens "
            "with jax.grad(jax.grad(...)), jax.hessian, or jax.jvp/jax.vjp of a VJP). First-order jax.grad works. "
            f"For higher-order derivatives use {alternative}."
        )

    guarded.defjvp(refuse)
    return guarded


def fold_vmap(fn: Callable, args: Sequence[Any], *, in_axes: Sequence[int | None], out_axes: int | Sequence[int]):
    """`fn(*args)`, vmapped by folding the mapped axis into each argument's `in_axes` entry.

    Args:
      fn: a function of the positional `args` (arrays or None), returning a pytree of arrays
        (or a list/tuple whose entries are arrays or None).
      args: the arguments.
      in_axes: per argument, the axis the mapped axis folds into, or None for an argument
        shared by every row (mapped: the call runs once per mapped element).
      out_axes: the axis of every output leaf that unfolds (an int), or one int per entry of
        a list/tuple output.

    Returns:
      `fn(*args)`.
    """
    args, in_axes = tuple(args), tuple(in_axes)
    if len(args) != len(in_axes):
        raise ValueError(f"in_axes: expected one entry per argument ({len(args)}), got {len(in_axes)}")

    @jax.custom_batching.custom_vmap
    def call(*args):
        return fn(*args)

    @call.def_vmap
    def rule(axis_size, in_batched, *args):
        batched = [any(jax.tree.leaves(b)) for b in in_batched]
        if axis_size == 0:
            outs = _empty_outputs(fn, args, batched)
        elif any(b and axis is None for b, axis in zip(batched, in_axes, strict=True)):
            outs = _sequential(fn, args, batched, in_axes, out_axes)
        else:
            folded = [
                x if axis is None or x is None else _fold(x, axis, axis_size, b)
                for x, axis, b in zip(args, in_axes, batched, strict=True)
            ]
            outs = fold_vmap(fn, folded, in_axes=in_axes, out_axes=out_axes)
            outs = _map_outputs(lambda y, axis: _unfold(y, axis, axis_size), outs, out_axes)
        return outs, jax.tree.map(lambda _: True, outs)

    return call(*args)


def _fold(x, axis: int, size: int, batched: bool):
    """[size, ..., d_axis, ...] (or unmapped [..., d_axis, ...]) to [..., size * d_axis, ...]."""
    if not batched:
        x = jnp.broadcast_to(x, (size, *x.shape))
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], size * x.shape[axis + 1], *x.shape[axis + 2 :])


def _unfold(y, axis: int, size: int):
    """[..., size * d, ...] to [size, ..., d, ...]."""
    y = y.reshape(*y.shape[:axis], size, y.shape[axis] // size, *y.shape[axis + 1 :])
    return jnp.moveaxis(y, axis, 0)


def _map_outputs(f, outs, out_axes):
    """`f(leaf, axis)` on every output leaf, with its axis from `out_axes`."""
    if isinstance(out_axes, int):
        return jax.tree.map(lambda y: f(y, out_axes), outs)
    if not isinstance(outs, list | tuple) or len(outs) != len(out_axes):
        raise ValueError("out_axes: expected an int, or one entry per output of a list/tuple output")
    mapped = (jax.tree.map(lambda y, axis=axis: f(y, axis), out) for out, axis in zip(outs, out_axes, strict=True))
    return type(outs)(mapped)


def _sequential(fn, args, batched, in_axes, out_axes):
    """One call per mapped element (`jax.lax.map`); outputs stacked along a leading axis."""

    def one(elements):
        elements = iter(elements)
        element_args = [next(elements) if b else x for x, b in zip(args, batched, strict=True)]
        return fold_vmap(fn, element_args, in_axes=in_axes, out_axes=out_axes)

    return jax.lax.map(one, [x for x, b in zip(args, batched, strict=True) if b])


def _empty_outputs(fn, args, batched):
    """Outputs of zero mapped elements: zeros of shape [0, ...] with each output's element shape."""
    element_args = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) if b else x for x, b in zip(args, batched, strict=True)]
    shapes = jax.eval_shape(fn, *element_args)
    return jax.tree.map(lambda s: jnp.zeros((0, *s.shape), s.dtype), shapes)
