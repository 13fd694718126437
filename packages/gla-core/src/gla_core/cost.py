"""The programs of the TPU cost report (`gla cost`): what is compiled, at which shapes.

A `Problem` is one op at one shape, its arrays described by `jax.ShapeDtypeStruct`s (no memory):
q/k/v bfloat16, gates float32, an initial state given and the final state returned; varlen
problems pack `sequences` sequences into one row (`cu_seqlens`, traced: the boundaries are run-time
values, so one compile covers every packing). Each problem has two programs: the forward,
`dispatch(...) -> (o, ht)`, and the training step, the forward plus its VJP with the cotangents
`do` and `dht` for every differentiable input, in one jitted program (`forward_fn`,
`training_step_fn`).

`build_program(spec)` turns the JSON spec of a program (how `gla_core.static_profile` compiles it in
a subprocess) into `(fn, argument structs)`; `gla_core.cost_peers` adds other libraries' kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from gla_core.dispatch import dispatch, explain
from gla_core.errors import InvalidArgumentError
from gla_core.overrides import use

OPS = ("simple_gla", "gla", "kda")
SIMPLE_GLA_GATES = ("g", "g_gamma")
STAGES = ("fwd", "train")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One op at one shape.

    Attributes:
      op: "simple_gla", "gla" or "kda".
      label: the shape in words.
      inputs: (name, struct) of every array the op takes, in program argument order (q, k, v, the
        gates, initial_state, then cu_seqlens for varlen problems).
      differentiable: the names of `inputs` that get gradients (all but cu_seqlens).
      spec: the arguments of `attention_problem` that rebuild it.
    """

    op: str
    label: str
    inputs: tuple[tuple[str, jax.ShapeDtypeStruct], ...]
    differentiable: tuple[str, ...]
    spec: dict[str, Any]

    @property
    def structs(self) -> list[jax.ShapeDtypeStruct]:
        return [struct for _, struct in self.inputs]

    @property
    def output(self) -> jax.ShapeDtypeStruct:
        """The struct of `o` (v's)."""
        return dict(self.inputs)["v"]

    @property
    def state(self) -> jax.ShapeDtypeStruct:
        """The struct of the initial (and final) state."""
        return dict(self.inputs)["initial_state"]


def _struct(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def attention_problem(
    op: str, batch: int, seq_len: int, heads: int, dim: int = 128, gate: str = "g", sequences: int | None = None
) -> Problem:
    """simple_gla/gla/kda at [batch, seq_len, heads, dim] bf16 with h0 and ht.

    `gate` chooses simple_gla's gate ("g" [B, T, H] or "g_gamma" [H]); gla takes `gk`, kda `g`
    and `beta`. `sequences`: a varlen problem of that many sequences packed into one row (batch 1).
    """
    if op not in OPS:
        raise InvalidArgumentError(f"op: expected one of {OPS}, got {op!r}")
    if op == "simple_gla" and gate not in SIMPLE_GLA_GATES:
        raise InvalidArgumentError(f"gate: simple_gla takes one of {SIMPLE_GLA_GATES}, got {gate!r}")
    if sequences is not None and batch != 1:
        raise InvalidArgumentError(f"batch: a varlen problem packs its {sequences} sequences into batch 1, got {batch}")
    b, t, h, d = batch, seq_len, heads, dim
    n = batch if sequences is None else sequences
    inputs: list[tuple[str, jax.ShapeDtypeStruct]] = [(name, _struct(b, t, h, d)) for name in ("q", "k", "v")]
    if op == "simple_gla":
        inputs.append((gate, _struct(b, t, h, dtype=jnp.float32) if gate == "g" else _struct(h, dtype=jnp.float32)))
    elif op == "gla":
        inputs.append(("gk", _struct(b, t, h, d, dtype=jnp.float32)))
    else:
        inputs += [("g", _struct(b, t, h, d, dtype=jnp.float32)), ("beta", _struct(b, t, h, dtype=jnp.float32))]
    inputs.append(("initial_state", _struct(n, h, d, d, dtype=jnp.float32)))
    differentiable = tuple(name for name, _ in inputs)
    if sequences is not None:
        inputs.append(("cu_seqlens", _struct(sequences + 1, dtype=jnp.int32)))
    packing = f"B=1 T={t} packed ({sequences} sequences)" if sequences is not None else f"B={b} T={t}"
    label = f"{packing} H={h} K=V={d} bf16" + (f", {gate}" if op == "simple_gla" else "") + ", h0/ht"
    spec = dict(op=op, batch=batch, seq_len=seq_len, heads=heads, dim=dim, gate=gate, sequences=sequences)
    return Problem(op, label, tuple(inputs), differentiable, spec)


def production_problems() -> list[Problem]:
    """The shapes of the issues: B=2 T=4096 H=16 K=V=128 bf16 (KDA also B=1 T=8192 H=32), and per
    op a varlen problem of B=1 T=8192 H=16 packed with 4 sequences."""
    return [
        attention_problem("simple_gla", 2, 4096, 16, gate="g_gamma"),
        attention_problem("simple_gla", 2, 4096, 16, gate="g"),
        attention_problem("gla", 2, 4096, 16),
        attention_problem("kda", 2, 4096, 16),
        attention_problem("kda", 1, 8192, 32),
        attention_problem("simple_gla", 1, 8192, 16, gate="g", sequences=4),
        attention_problem("gla", 1, 8192, 16, sequences=4),
        attention_problem("kda", 1, 8192, 16, sequences=4),
    ]


# The small problems: the shortest length at which the kernels' blocks (up to 512 tokens) have a probe
# pair (T=512 and 1024) shorter than the problem, so a small run exercises the whole method, and a
# quarter of the heads.
SMALL_SEQ_LEN = 2048
SMALL_HEADS_DIVISOR = 4


def small_problems() -> list[Problem]:
    """`production_problems` at B=1 T=2048 with a quarter of the heads (same dims, gates, sequences): a
    trial of the whole report (probes, full-shape compiles, the scaling's error) in a fraction of its time."""
    return [
        attention_problem(
            **{**p.spec, "batch": 1, "seq_len": SMALL_SEQ_LEN, "heads": p.spec["heads"] // SMALL_HEADS_DIVISOR}
        )
        for p in production_problems()
    ]


def _call(problem: Problem, impl: str | None, impl_options: dict | None, values: dict):
    """`dispatch` of the problem's op on `values` (its inputs by name), the final state returned."""
    arrays = tuple(values.pop(name) for name in ("q", "k", "v"))
    options = impl_options or {}
    return dispatch(problem.op, *arrays, impl=impl, impl_options=options, output_final_state=True, **values)


def forward_fn(problem: Problem, impl: str | None, impl_options: dict | None = None):
    """fn(*problem inputs) -> (o, final state)."""
    names = [name for name, _ in problem.inputs]

    def forward(*values):
        return _call(problem, impl, impl_options, dict(zip(names, values, strict=True)))

    return forward


def training_step_fn(problem: Problem, impl: str | None, impl_options: dict | None = None):
    """fn(*problem inputs, do, dht) -> ((o, final state), gradients of sum(o * do) + sum(final
    state * dht) for every differentiable input)."""
    names = [name for name, _ in problem.inputs]

    def step(*args):
        given = dict(zip(names, args[:-2], strict=True))
        do, dht = args[-2:]
        fixed = {name: value for name, value in given.items() if name not in problem.differentiable}

        def run(*values):
            return _call(
                problem, impl, impl_options, {**fixed, **dict(zip(problem.differentiable, values, strict=True))}
            )

        outputs, vjp = jax.vjp(run, *(given[name] for name in problem.differentiable))
        return outputs, vjp((do, dht))

    return step


def training_structs(problem: Problem) -> list[jax.ShapeDtypeStruct]:
    """Arguments of `training_step_fn(problem, impl)`: the problem's inputs, then `do` and `dht`."""
    return [*problem.structs, problem.output, problem.state]


def chosen_implementation(problem: Problem) -> str:
    """The implementation `dispatch` picks for the problem on TPU (by priority, no override)."""
    values = dict(problem.inputs)
    arrays = tuple(values.pop(name) for name in ("q", "k", "v"))
    with use(backend="tpu", interpret=False):
        return explain(problem.op, *arrays, output_final_state=True, **values).chosen().name


def program_spec(problem: Problem, stage: str, impl: str | None = None, impl_options: dict | None = None) -> dict:
    """The `build_program` spec of the problem's forward ("fwd") or training step ("train")."""
    if stage not in STAGES:
        raise InvalidArgumentError(f"stage: expected one of {STAGES}, got {stage!r}")
    spec = {"program": "attention", **problem.spec, "impl": impl, "stage": stage}
    return {**spec, "impl_options": impl_options} if impl_options else spec


def build_program(spec: dict):
    """`(fn, argument structs)` of the program a `gla_core.static_profile` spec describes.

    `{"program": "matmul", "size": N}`: an N^3 bfloat16 matmul (the clock calibration);
    `{"program": "attention", <attention_problem arguments>, "impl", "stage"}`: the forward (`stage`
    "fwd") or the training step ("train") of `attention_problem(...)` with `impl` (None: the default
    implementation on TPU) and `impl_options` if given (`program_spec`);
    `{"program": "peer", ...}`: another library's kernels (`gla_core.cost_peers.build_peer`);
    `{"program": "decode", "op"}`: the serving decode step of `gla_core.decode.serving.serving_problem(op)`
    (its pool is argument `spec["donate_argnums"]`, see `gla_core.cost_decode`).
    """
    kind = spec["program"]
    if kind == "decode":
        from gla_core.decode.serving import serving_problem

        problem = serving_problem(spec["op"])
        return problem.fn, list(problem.structs)
    if kind == "matmul":
        n = spec["size"]
        matrix = _struct(n, n)
        return (lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)), [matrix, matrix]
    if kind == "peer":
        from gla_core.cost_peers import build_peer

        return build_peer(spec)
    if kind != "attention":
        raise InvalidArgumentError(f"program: expected attention, peer, matmul or decode, got {kind!r}")
    names = ("op", "batch", "seq_len", "heads", "dim", "gate", "sequences")
    arguments = {name: spec[name] for name in names if name in spec}
    problem = attention_problem(**arguments)
    options = spec.get("impl_options") or {}
    if spec["stage"] == "fwd":
        return forward_fn(problem, spec["impl"], options), problem.structs
    return training_step_fn(problem, spec["impl"], options), training_structs(problem)
