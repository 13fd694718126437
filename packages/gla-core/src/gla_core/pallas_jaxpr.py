"""The Pallas calls of a traced program: finding them, and replacing them with empty kernels.

`pallas_equations(jaxpr)` lists every `pallas_call` of a program, nested ones included (inside
`jit`, `custom_vjp`, `cond`, `scan`, ...), in program order: the order `gla_core.static_profile`
numbers kernels by when it compiles each one alone.

`stub_kernels(closed_jaxpr)` returns the same program with every `pallas_call` replaced by an
empty kernel that takes the same operands, returns results of the same shapes and aliases the
same buffers, but leaves its operands in HBM and does no work. XLA then compiles everything
around the kernels exactly as it must for the real program (the same operands to materialize,
the same transposes and copies), while the kernels themselves cost almost nothing to compile
and to profile: the static profile of the stubbed program gives the cycles of the XLA side.
"""

from __future__ import annotations

from typing import Any

PALLAS_PRIMITIVE = "pallas_call"
STUB_NAME = "pallas_stub"


def _inner_jaxpr(value: Any):
    """The jaxpr a parameter value holds (a Jaxpr, or a ClosedJaxpr's), or None."""
    inner = getattr(value, "jaxpr", value)
    return inner if hasattr(inner, "eqns") else None


def pallas_equations(jaxpr) -> list:
    """Every `pallas_call` equation of a jaxpr and of the jaxprs nested in it, in program order."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == PALLAS_PRIMITIVE:
            found.append(eqn)
            continue
        for param in eqn.params.values():
            for value in param if isinstance(param, (tuple, list)) else (param,):
                inner = _inner_jaxpr(value)
                if inner is not None:
                    found.extend(pallas_equations(inner))
    return found


def _stub_equation(eqn):
    """A `pallas_call` equation on the same variables whose kernel does nothing."""
    import jax
    from jax.experimental import pallas as pl

    operands = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    results = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.outvars]
    in_hbm = pl.BlockSpec(memory_space=pl.ANY)

    def empty(*refs) -> None:
        del refs

    def call(*arrays):
        return pl.pallas_call(
            empty,
            out_shape=results,
            in_specs=[in_hbm] * len(operands),
            out_specs=[in_hbm] * len(results),
            input_output_aliases=dict(eqn.params.get("input_output_aliases", ())),
            name=STUB_NAME,
        )(*arrays)

    (stub,) = jax.make_jaxpr(call)(*operands).jaxpr.eqns
    return stub.replace(invars=list(eqn.invars), outvars=list(eqn.outvars))


def _stub_value(value: Any) -> Any:
    from jax._src import core

    if isinstance(value, core.ClosedJaxpr):
        return value.replace(jaxpr=_stub_jaxpr(value.jaxpr))
    if isinstance(value, core.Jaxpr):
        return _stub_jaxpr(value)
    if isinstance(value, (tuple, list)) and any(_inner_jaxpr(item) is not None for item in value):
        return type(value)(_stub_value(item) for item in value)
    return value


def _stub_jaxpr(jaxpr):
    eqns = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == PALLAS_PRIMITIVE:
            eqns.append(_stub_equation(eqn))
        else:
            eqns.append(eqn.replace(params={name: _stub_value(value) for name, value in eqn.params.items()}))
    return jaxpr.replace(eqns=eqns)


def stub_kernels(closed_jaxpr):
    """`closed_jaxpr` with every `pallas_call`, nested ones included, replaced by an empty kernel."""
    return closed_jaxpr.replace(jaxpr=_stub_jaxpr(closed_jaxpr.jaxpr))
