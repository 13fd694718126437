"""Meshes, cases and the comparison of a context-parallel run with the single-device run and the
float64 oracle.

Every comparison covers the outputs, the final states (when requested) and the gradient of every
differentiable input, with the oracle's seeded cotangents: against the oracle within
`TOLERANCES[dtype]`, against the same implementation on one device within
`TOLERANCES["float32_rearranged"]` for float32 inputs (the same float32 arithmetic, split at shard
boundaries) and `TOLERANCES["bfloat16"]` for bfloat16 ones (outputs are rounded to bfloat16 before
the carried-in state's contribution is added, and again after).
Programs are compiled like the oracle, with XLA's backend optimizations off (3-4x faster compiles
on CPU; the program's arithmetic is the same).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import gla_core
from gla_ref import testing

SEQ_LEN = 96
# Packed sequences over T = 96: inside one shard, spanning one or several boundaries (shard 1 of 8
# lies inside [5, 30)), ending or starting exactly on a boundary (48), empty (at 5, 48 and T).
CU_SEQLENS = (0, 5, 5, 30, 48, 48, 53, 96, 96)

CASES = {
    "simple_gla-g": dict(op="simple_gla", batch=2, initial_state=True, output_final_state=True),
    "simple_gla-g_gamma": dict(op="simple_gla", batch=2, num_heads=2, gates=("g_gamma",)),
    "simple_gla-packed": dict(
        op="simple_gla", gates=("g", "g_gamma"), cu_seqlens=CU_SEQLENS, initial_state=True, output_final_state=True
    ),
    "gla": dict(op="gla", batch=2, initial_state=True, output_final_state=True),
    "gla-packed": dict(op="gla", cu_seqlens=CU_SEQLENS, initial_state=True, output_final_state=True),
    "kda-grouped": dict(op="kda", batch=2, num_heads=2, num_value_heads=4, initial_state=True, output_final_state=True),
    "kda-packed": dict(
        op="kda",
        cu_seqlens=CU_SEQLENS,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        initial_state=True,
        output_final_state=True,
    ),
    "kda-no-state": dict(op="kda", batch=1),
    "kda-bf16": dict(op="kda", batch=2, dtype=jnp.bfloat16, initial_state=True, output_final_state=True),
    "simple_gla-small": dict(op="simple_gla", seq_len=64, num_heads=1, initial_state=True, output_final_state=True),
}

# name: (axis sizes, axis names); every mesh uses the first devices of the 8.
MESHES = {
    "cp2": ((2,), ("cp",)),
    "cp4": ((4,), ("cp",)),
    "cp8": ((8,), ("cp",)),
    "dp2xcp4": ((2, 4), ("dp", "cp")),
    "cp4xhp2": ((4, 2), ("cp", "hp")),
}


@functools.cache
def case(name: str) -> testing.Case:
    """The case `name` of `CASES`: T = 96 unless it says, K = V = 16, chunks of 16 (shards of 12 to
    48 tokens: shorter than a chunk, or not a multiple of it)."""
    spec = dict(CASES[name])
    op = spec.pop("op")
    spec.setdefault("num_heads", 2)
    spec.setdefault("seq_len", SEQ_LEN)
    return testing.make_case(op, key_dim=16, value_dim=16, chunk_size=16, **spec)


@functools.cache
def mesh(name: str, explicit: bool = True) -> jax.sharding.Mesh:
    """Mesh `name` of `MESHES`, with explicit axes (arrays carry their sharding) or automatic ones."""
    shape, axes = MESHES[name]
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, axes, axis_types=(kind,) * len(axes))


# --------------------------------------------------------------------------- runners: fn(**case.kwargs())


def sharded(op: str, mesh_name: str, impl: str, *, exchange="all_gather", batch_axis=None, head_axis=None, **how):
    """`gla_core.dispatch_sharded` on the global arrays (it builds the shard_map, check_vma=False)."""

    def fn(q, k, v, **kwargs):
        return gla_core.dispatch_sharded(
            op,
            q,
            k,
            v,
            mesh=mesh(mesh_name),
            context_axis="cp",
            batch_axis=batch_axis,
            head_axis=head_axis,
            context_exchange=exchange,
            impl=impl,
            **how,
            **kwargs,
        )

    return fn


def in_shard_map(op: str, mesh_name: str, impl: str, *, exchange="all_gather", batch_axis=None):
    """`gla_core.dispatch(..., context_axis="cp")` inside the test's own `jax.shard_map` (check_vma=False,
    automatic mesh axes so that the shard_map places the arrays); final state requested."""

    def fn(**kwargs):
        arrays = {name: x for name, x in kwargs.items() if isinstance(x, jax.Array)}
        static = {name: x for name, x in kwargs.items() if name not in arrays}
        varlen = arrays.get("cu_seqlens") is not None
        specs = {name: _in_spec(name, batch_axis, varlen) for name in arrays}

        def per_device(arrays):
            arrays = dict(arrays)
            q, k, v = arrays.pop("q"), arrays.pop("k"), arrays.pop("v")
            return gla_core.dispatch(
                op, q, k, v, context_axis="cp", context_exchange=exchange, impl=impl, **arrays, **static
            )

        out_specs = (P(batch_axis, "cp"), P(None if varlen else batch_axis))
        mapped = jax.shard_map(
            per_device, mesh=mesh(mesh_name, explicit=False), in_specs=(specs,), out_specs=out_specs, check_vma=False
        )
        return mapped(arrays)

    return fn


def _in_spec(name: str, batch_axis, varlen: bool) -> P:
    if name in ("q", "k", "v", "g", "gk", "beta"):
        return P(batch_axis, "cp")
    if name == "initial_state":
        return P(None if varlen else batch_axis)
    return P()


def single_device(op: str, impl: str, interpret: bool = False):
    """The same implementation on one device: what context parallelism must reproduce."""

    def fn(q, k, v, **kwargs):
        return gla_core.dispatch(op, q, k, v, impl=impl, interpret=interpret, **kwargs)

    return fn


# --------------------------------------------------------------------------- comparison


def forward_and_vjp(fn, case: testing.Case) -> dict[str, np.ndarray]:
    """fn's outputs and VJP on `case` with the oracle's cotangents, as float64 arrays keyed like the
    oracle's ("o", "final_state", "d" + input name); one jitted program, compiled like the oracle."""
    names = case.differentiable
    constant = {n: x for n, x in case.inputs.items() if n not in names}
    shapes = {"o": case.inputs["v"].shape}
    if case.options["output_final_state"]:
        v, num_states = case.inputs["v"], case.inputs["q"].shape[0]
        if case.options["cu_seqlens"] is not None:
            num_states = case.options["cu_seqlens"].shape[0] - 1
        shapes["final_state"] = (num_states, v.shape[2], case.inputs["q"].shape[3], v.shape[3])
    cts = testing.cotangents(case, shapes, seed=0)

    def forward(values):
        return fn(**dict(zip(names, values, strict=True)), **constant, **case.options)

    def run(values, cts):
        (o, final_state), vjp = jax.vjp(forward, values)
        cotangent = (cts["o"].astype(o.dtype), None if final_state is None else cts["final_state"])
        return {"o": o, "final_state": final_state}, vjp(cotangent)[0]

    values = tuple(case.inputs[n] for n in names)
    cts = {n: jnp.asarray(x, jnp.float32 if n == "final_state" else case.inputs["v"].dtype) for n, x in cts.items()}
    program = jax.jit(run).lower(values, cts).compile(testing.ORACLE_COMPILER_OPTIONS)
    outputs, grads = program(values, cts)
    result = {n: np.asarray(x, np.float64) for n, x in outputs.items() if x is not None}
    result.update({"d" + n: np.asarray(g, np.float64) for n, g in zip(names, grads, strict=True)})
    return result


@functools.cache
def _single_device_result(case_name: str, impl: str, interpret: bool) -> dict[str, np.ndarray]:
    current = case(case_name)
    return forward_and_vjp(single_device(current.op, impl, interpret), current)


def check(case_name: str, impl: str, fn, label: str, interpret: bool = False) -> dict[str, tuple[float, float]]:
    """Compares `fn` (a context-parallel runner) on case `case_name` with the oracle and with `impl` on
    one device (in TPU interpret mode when `interpret`); raises AssertionError naming every tensor out
    of bounds. Returns per tensor (error vs oracle, error vs single device)."""
    current = case(case_name)
    reference = testing.oracle(current)
    expected = {**reference.outputs, **reference.grads}
    single = _single_device_result(case_name, impl, interpret)
    got = forward_and_vjp(fn, current)
    if set(got) != set(expected):
        raise AssertionError(f"{label}: tensors {sorted(got)}, expected {sorted(expected)}")
    oracle_bound = testing.tolerance_for(current.dtype)
    rearranged = testing.TOLERANCES["float32_rearranged" if current.dtype == jnp.float32 else "bfloat16"]
    errors, failures = {}, []
    for name, value in got.items():
        is_output = name in ("o", "final_state")
        for against, bound in (
            (expected[name], oracle_bound.output if is_output else oracle_bound.grad),
            (single[name], rearranged.output if is_output else rearranged.grad),
        ):
            try:
                testing.assert_close(name, value, against, bound, label=f"{label} {current.label}")
            except AssertionError as failure:
                which = "oracle" if against is expected[name] else "single device"
                failures.append(f"vs {which}: {failure}")
        errors[name] = (testing.relative_error(value, expected[name]), testing.relative_error(value, single[name]))
    if failures:
        raise AssertionError(f"{label} {current.label}:\n  " + "\n  ".join(failures))
    return errors
