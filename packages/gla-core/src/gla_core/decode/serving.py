"""The decode program at a production serving shape, with its HBM floor (for the TPU cost report).

`serving_problem(op)` describes one decode step of a serving batch: N sequences with one token each
(or S tokens each for speculative decoding), their states in a pool of P slots addressed by
`ssm_state_indices`, arrays as `jax.ShapeDtypeStruct`s (no memory). `problem.fn(*problem.structs)`
runs `gla_core.dispatch` with the pool donated (`problem.donate_argnums`), so the kernel updates it
in place. `problem.hbm_floor_bytes` is what any implementation must move: every state read from
and written to the pool, the tokens read and `o` written; the states dominate (a [K, V] float32
state is 64 KiB against a few hundred bytes of tokens per head).

Example (for `gla cost`; needs jax[tpu] for the compile-only device):
  >>> problem = serving_problem("kda")
  >>> report = compile_for_tpu(problem.fn, problem.structs, chip="v6e", donate_argnums=problem.donate_argnums)
  >>> floor_seconds = problem.hbm_floor_bytes / 1640e9
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from gla_core.decode.registration import PALLAS


@dataclasses.dataclass(frozen=True)
class ServingProblem:
    """One decode step at a serving shape.

    Attributes:
      op: "simple_gla", "gla" or "kda".
      impl: the implementation `fn` forces ("decode": the Pallas kernel).
      label: one line for people.
      names: the names of `structs` (q, k, v, the gates, the pool, the indices, ...).
      structs: the positional arguments of `fn`.
      fn: `fn(*structs) -> (o, updated pool)` through `gla_core.dispatch`.
      donate_argnums: the pool's position (donate it: the update is in place).
      hbm_floor_bytes: states read + states written + tokens read + o written.
    """

    op: str
    impl: str
    label: str
    names: tuple[str, ...]
    structs: tuple[jax.ShapeDtypeStruct, ...]
    fn: Callable
    donate_argnums: tuple[int, ...]
    hbm_floor_bytes: int


def _nbytes(struct) -> int:
    return math.prod(struct.shape) * jnp.dtype(struct.dtype).itemsize


def serving_problem(
    op: str,
    *,
    num_sequences: int = 256,
    heads: int = 16,
    dim: int = 128,
    pool_slots: int = 1024,
    tokens_per_sequence: int = 1,
    dtype=jnp.bfloat16,
    pool_dtype=jnp.float32,
    state_v_first: bool = False,
    impl: str = PALLAS,
) -> ServingProblem:
    """The decode step of `op` for `num_sequences` sequences of `tokens_per_sequence` tokens.

    Shapes: q, k [N, S, H, K]; v [N, S, H, V] (K = V = `dim`, inputs in `dtype`); the pool
    [P, H, K, V] (or [P, H, V, K]) in `pool_dtype`; ssm_state_indices int32 [N] for one token per
    sequence, else [N, S] with num_accepted_tokens [N] (speculative decoding: a slot per token).
    Gates: simple_gla g [N, S, H]; gla gk [N, S, H, K]; kda g [N, S, H, K] and beta [N, S, H].
    """
    n, s, h, d = num_sequences, tokens_per_sequence, heads, dim
    struct = lambda *shape, dt=dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
    arrays = {"q": struct(n, s, h, d), "k": struct(n, s, h, d), "v": struct(n, s, h, d)}
    if op == "simple_gla":
        arrays["g"] = struct(n, s, h)
    elif op == "gla":
        arrays["gk"] = struct(n, s, h, d)
    elif op == "kda":
        arrays.update(g=struct(n, s, h, d), beta=struct(n, s, h))
    else:
        raise ValueError(f"op: expected simple_gla, gla or kda, got {op!r}")
    arrays["initial_state"] = struct(pool_slots, h, d, d, dt=pool_dtype)
    arrays["ssm_state_indices"] = struct(n, dt=jnp.int32) if s == 1 else struct(n, s, dt=jnp.int32)
    if s > 1:
        arrays["num_accepted_tokens"] = struct(n, dt=jnp.int32)
    names = tuple(arrays)

    def fn(*values):
        from gla_core.dispatch import dispatch

        named = dict(zip(names, values, strict=True))
        q, k, v = (named.pop(x) for x in ("q", "k", "v"))
        return dispatch(op, q, k, v, **named, state_v_first=state_v_first, impl=impl)

    state = _nbytes(struct(h, d, d, dt=pool_dtype))
    tokens = sum(_nbytes(x) for name, x in arrays.items() if name not in ("initial_state",))
    floor = n * state + n * s * state + tokens + _nbytes(arrays["v"])
    layout = "[V, K]" if state_v_first else "[K, V]"
    label = (
        f"{op} decode N={n} tokens/seq={s} H={h} K=V={d} {jnp.dtype(dtype).name}, "
        f"pool P={pool_slots} {jnp.dtype(pool_dtype).name} {layout}"
    )
    return ServingProblem(
        op, impl, label, names, tuple(arrays.values()), fn, (names.index("initial_state"),), int(floor)
    )
