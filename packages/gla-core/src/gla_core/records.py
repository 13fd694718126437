"""The two frozen records the registry works with: `Call` and `Implementation`.

A `Call` describes one validated request (no arrays, only static facts about them), an
`Implementation` describes one way of serving an op. Resolution is a pure function of
the two, so both can be built by hand in tests without any JAX array.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

BACKENDS = frozenset({"cpu", "gpu", "tpu"})
FIRST_PARTY_DISTRIBUTIONS = frozenset({"gla-core", "gla-ref", "gla-simple", "gla-fused", "gla-kda"})


@dataclasses.dataclass(frozen=True)
class Call:
    """Static description of one validated request.

    Shapes follow FLA's names: q/k are `[batch, seq_len, num_heads, key_dim]`, v is
    `[batch, seq_len, num_value_heads, value_dim]` (`num_value_heads == num_heads`
    except for kda with grouped value heads). For kda_gate, `g` is
    `[batch, seq_len, num_value_heads, key_dim]` and `value_dim` is None.

    Attributes:
      op: the op's name (see `gla_core.ops`).
      dtype: dtype name of the main inputs (q, k, v; g for kda_gate), e.g. "bfloat16".
      gates: which gate arguments are given: a subset of {"g", "g_gamma", "gk"}.
        For simple_gla, {"g", "g_gamma"} means a per-step decay of g + g_gamma.
      has_initial_state: `initial_state` was given.
      output_final_state: the final state is requested.
      num_sequences: N for packed varlen input (`cu_seqlens` given), else None.
      chunk_size: chunk length requested (None for kda_gate).
      backend: the backend the call runs on ("cpu", "gpu", "tpu").
      interpret: Pallas TPU kernels may run in TPU interpret mode.
      options: op-specific static options as sorted (name, value) pairs, e.g.
        ("use_qk_l2norm_in_kernel", True) for kda.
      context_axis: the mesh axis T is sharded over when this is one device's part of a
        context-parallel call (`dispatch(..., context_axis=...)`), else None.
    """

    op: str
    batch: int = 1
    seq_len: int = 1
    num_heads: int = 1
    key_dim: int = 1
    value_dim: int | None = 1
    num_value_heads: int | None = None
    dtype: str = "float32"
    gates: frozenset[str] = frozenset()
    has_initial_state: bool = False
    output_final_state: bool = False
    num_sequences: int | None = None
    chunk_size: int | None = 64
    backend: str = "cpu"
    interpret: bool = False
    options: tuple[tuple[str, Any], ...] = ()
    context_axis: str | None = None

    def __post_init__(self):
        if self.num_value_heads is None:
            object.__setattr__(self, "num_value_heads", self.num_heads)
        object.__setattr__(self, "gates", frozenset(self.gates))
        object.__setattr__(self, "options", tuple(sorted(dict(self.options).items())))

    @property
    def varlen(self) -> bool:
        """True when the input is packed sequences described by `cu_seqlens`."""
        return self.num_sequences is not None

    def option(self, name: str, default: Any = None) -> Any:
        """The value of an op-specific option, or `default` when it is absent."""
        return dict(self.options).get(name, default)

    def describe(self) -> str:
        """One line for people: op, shape, dtype, gates and flags."""
        heads = f"H={self.num_heads}"
        if self.num_value_heads != self.num_heads:
            heads += f" HV={self.num_value_heads}"
        dims = f"K={self.key_dim}" + (f" V={self.value_dim}" if self.value_dim is not None else "")
        parts = [f"{self.op} B={self.batch} T={self.seq_len} {heads} {dims} {self.dtype}"]
        if self.gates:
            parts.append("gates=" + "+".join(sorted(self.gates)))
        if self.varlen:
            parts.append(f"varlen N={self.num_sequences}")
        if self.has_initial_state:
            parts.append("h0")
        if self.output_final_state:
            parts.append("ht")
        if self.chunk_size is not None:
            parts.append(f"chunk={self.chunk_size}")
        parts.extend(f"{k}={v}" for k, v in self.options)
        if self.context_axis is not None:
            parts.append(f"context_axis={self.context_axis}")
        parts.append(f"backend={self.backend}" + (" (interpret)" if self.interpret else ""))
        return " ".join(parts)


def accept_every_call(call: Call) -> str | None:
    """The default `supports` predicate: accepts every call."""
    return None


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way of serving an op.

    Attributes:
      op: the op served (an installed op, see `gla_core.ops`).
      name: short name, unique per op (`impl="name"` selects it).
      fn: `fn(arguments)` with the op's validated arguments record (`OpSpec.arguments`: every
        array and keyword of the op, normalized, plus `interpret` and `options`); returns what
        the op returns. The registry runs it under `jax.jit` (static fields of the record are
        static). It owns its backward (`jax.custom_vjp`) so `jax.grad` through dispatch works.
      priority: higher wins among accepting implementations of one op.
      backends: the backends it runs on natively.
      package: the distribution that provides it, for `gla list`.
      supports: `supports(call) -> None` to accept, or the human reason it declines.
      interpretable: a Pallas TPU kernel that can also run off-TPU in TPU interpret
        mode when the call asks for it (`interpret=True`, `GLA_INTERPRET=1`,
        `gla_core.use(interpret=True)`).
      description: one line for `gla list`.
      options: the per-call options it takes (`gla_core.options.Option`), validated by their
        `check` and passed as `arguments.options`.
    """

    op: str
    name: str
    fn: Callable[..., Any]
    priority: int
    backends: frozenset[str]
    package: str
    supports: Callable[[Call], str | None] = accept_every_call
    interpretable: bool = False
    description: str = ""
    options: tuple[Any, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "backends", frozenset(self.backends))
        object.__setattr__(self, "options", tuple(self.options))
