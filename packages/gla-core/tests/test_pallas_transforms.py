"""`gla_core.pallas_transforms` on a small Pallas TPU kernel in TPU interpret mode.

The kernel, `out[b] = w * x[b] + y[b]` over a grid of batch rows (w shared by every row), has
dimension semantics like every gla kernel (Pallas' own batching rule adds a grid axis without
one, which TPU interpret mode rejects: the failure `fold_vmap` avoids). It is checked against
the same formula in numpy (up to float32 summation order): under `jax.vmap` (mapped axis folded
into the batch axis, broadcast unmapped rows, a mapped shared argument run once per element,
nested vmaps, a zero-size axis, `jax.grad` under vmap) and under autodiff (`first_order_only`:
first-order gradients work, higher-order ones raise a clear error).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from gla_core.chunk.common import compiler_params
from gla_core.errors import GlaError
from gla_core.pallas_transforms import HigherOrderDerivativeError, first_order_only, fold_vmap
from gla_core.tpu import interpret_params
from gla_ref.testing import TOLERANCES, assert_close

pytestmark = pytest.mark.interpret

ROWS, LANES = 8, 128


def _axpy_kernel(w_ref, x_ref, y_ref, out_ref, total_ref):
    out = w_ref[...] * x_ref[...] + y_ref[...]
    out_ref[...] = out
    total_ref[...] = jnp.broadcast_to(jnp.sum(out, axis=(0, 1), keepdims=True), total_ref.shape)


def _launch(w, x, y, *, interpret: bool):
    """(out [B, 8, 128], total [B, 8, 128]: every element the sum of out[b])."""
    row = pl.BlockSpec((None, ROWS, LANES), lambda b: (b, 0, 0))
    return pl.pallas_call(
        _axpy_kernel,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)] * 2,
        grid=(x.shape[0],),
        in_specs=[pl.BlockSpec((ROWS, LANES), lambda b: (0, 0)), row, row],
        out_specs=[row, row],
        compiler_params=compiler_params("parallel"),
        interpret=interpret_params(interpret),
    )(w, x, y)


def axpy(w, x, y, interpret: bool):
    """The kernel through `fold_vmap`: x, y fold into B, w is shared."""
    return fold_vmap(functools.partial(_launch, interpret=interpret), (w, x, y), in_axes=(None, 0, 0), out_axes=0)


def _expected(w, x, y):
    out = np.asarray(w) * np.asarray(x) + np.asarray(y)
    return out, np.broadcast_to(out.sum(axis=(-2, -1), keepdims=True), out.shape)


def _random(*shape, seed: int):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((*shape, ROWS, LANES)), jnp.float32)


def _assert_equal(got, expected):
    """Equal up to float32 summation order (the kernel sums rows in its own order)."""
    for index, (value, reference) in enumerate(zip(got, expected, strict=True)):
        assert_close(f"output {index}", value, reference, TOLERANCES["float32_rearranged"].output)


VMAPS = {
    # name: (in_axes of (w, x, y), shapes of (w, x, y) as leading dims)
    "x and y mapped": ((None, 0, 0), ((), (3, 2), (3, 2))),
    "x mapped on axis 1, y unmapped (broadcast)": ((None, 1, None), ((), (2, 3), (2,))),
    "w mapped (shared argument: once per element)": ((0, None, None), ((3,), (2,), (2,))),
    "everything mapped": ((0, 0, 0), ((3,), (3, 2), (3, 2))),
}


@pytest.mark.parametrize("name", VMAPS)
def test_vmap_matches_the_formula_per_element(name, interpret):
    in_axes, shapes = VMAPS[name]
    w, x, y = (_random(*shape, seed=seed) for seed, shape in enumerate(shapes))
    out = jax.jit(jax.vmap(functools.partial(axpy, interpret=interpret), in_axes=in_axes))(w, x, y)
    for i in range(3):
        element = [a if axis is None else jnp.take(a, i, axis=axis) for a, axis in zip((w, x, y), in_axes, strict=True)]
        _assert_equal([o[i] for o in out], _expected(*element))


def test_nested_vmaps_fold_twice(interpret):
    w, x, y = _random(seed=0), _random(4, 3, 2, seed=1), _random(3, 2, seed=2)
    inner = jax.vmap(functools.partial(axpy, interpret=interpret), in_axes=(None, 0, 0))
    out = jax.jit(jax.vmap(inner, in_axes=(None, 0, None)))(w, x, y)
    _assert_equal(out, _expected(w, x, np.broadcast_to(y, x.shape)))


def test_zero_size_vmap_launches_nothing(interpret):
    w, x, y = _random(seed=0), _random(0, 2, seed=1), _random(0, 2, seed=2)
    out, total = jax.vmap(functools.partial(axpy, interpret=interpret), in_axes=(None, 0, 0))(w, x, y)
    assert out.shape == x.shape and total.shape == x.shape


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def guarded_axpy(w, x, y, interpret):
    return axpy(w, x, y, interpret)[0]


def _fwd(w, x, y, interpret):
    return axpy(w, x, y, interpret)[0], (w, x)


def _bwd(interpret, residuals, d_out):
    w, x = residuals
    # d x = w * d_out and d y = d_out through the kernel itself (a second launch); d w summed over rows
    dx, _ = axpy(w, d_out, jnp.zeros_like(d_out), interpret)
    return jnp.sum(x * d_out, axis=0), dx, d_out


guarded_axpy.defvjp(
    first_order_only(_fwd, implementation="axpy", op="toy", nondiff_argnums=(3,)),
    first_order_only(_bwd, implementation="axpy", op="toy", nondiff_argnums=(0,)),
)


def _loss(w, x, y, interpret):
    return jnp.sum(guarded_axpy(w, x, y, interpret) ** 2)


def test_first_order_gradient_works_also_under_vmap(interpret):
    w, x, y = _random(seed=0), _random(3, 2, seed=1), _random(3, 2, seed=2)
    grads = jax.jit(jax.vmap(jax.grad(_loss, argnums=(0, 1, 2)), in_axes=(None, 0, 0, None)), static_argnums=3)(
        w, x, y, interpret
    )
    out = np.asarray(w) * np.asarray(x) + np.asarray(y)
    expected = (np.sum(2 * out * np.asarray(x), axis=1), 2 * out * np.asarray(w), 2 * out)
    _assert_equal(grads, expected)


SECOND_ORDER = {
    "grad of grad": lambda w, x, y, i: jax.grad(lambda x: jnp.sum(jax.grad(_loss, argnums=1)(w, x, y, i)))(x),
    "hessian": lambda w, x, y, i: jax.hessian(_loss, argnums=0)(w, x, y, i),
    "jvp of the vjp (cotangent)": lambda w, x, y, i: jax.jvp(
        jax.vjp(lambda x: guarded_axpy(w, x, y, i), x)[1], (y,), (y,)
    ),
    "jvp of the vjp (primal)": lambda w, x, y, i: jax.jvp(
        lambda x: jax.vjp(lambda x: guarded_axpy(w, x, y, i), x)[1](y), (x,), (x,)
    ),
}


@pytest.mark.parametrize("name", SECOND_ORDER)
def test_higher_order_derivatives_raise_a_clear_error(name, interpret):
    w, x, y = _random(seed=0), _random(2, seed=1), _random(2, seed=2)
    with pytest.raises(HigherOrderDerivativeError, match=r"toy impl='axpy'.*use impl='xla'") as raised:
        SECOND_ORDER[name](w, x, y, interpret)
    assert isinstance(raised.value, GlaError) and isinstance(raised.value, NotImplementedError)
