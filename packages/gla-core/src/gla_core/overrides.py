"""Overrides that change dispatch without code changes.

`gla_core.use(simple_gla="chunk", backend="tpu", interpret=True)` is a context manager
(nestable, thread- and task-local); `GLA_IMPL_<OP>=name` environment variables force an
implementation per op. Precedence: `impl=` on the call, then `use()`, then the
environment, then priority.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterator, Mapping
from types import MappingProxyType

from gla_core.errors import InvalidArgumentError, UnknownOpError
from gla_core.records import BACKENDS, OPS


@dataclasses.dataclass(frozen=True)
class Overrides:
    """The active overrides: forced implementation per op, target backend, interpret mode."""

    implementations: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    backend: str | None = None
    interpret: bool | None = None


NO_OVERRIDES = Overrides()
_ACTIVE: contextvars.ContextVar[Overrides | None] = contextvars.ContextVar("gla_overrides", default=None)


def current() -> Overrides:
    """The overrides set by the innermost active `use()`."""
    return _ACTIVE.get() or NO_OVERRIDES


@contextlib.contextmanager
def use(*, backend: str | None = None, interpret: bool | None = None, **implementations: str) -> Iterator[Overrides]:
    """Overrides dispatch inside a `with` block.

    Args:
      backend: target backend ("cpu", "gpu", "tpu"). "tpu" on a host without a TPU lets
        Pallas implementations be chosen so they can be lowered with
        `jax.export(..., platforms=["tpu"])` or compiled for compile-only TPU devices.
      interpret: run Pallas TPU kernels in TPU interpret mode (off-TPU testing).
      **implementations: op name to implementation name, e.g. `simple_gla="chunk"`.

    Example:
      >>> with gla_core.use(simple_gla="xla"):
      ...     o, _ = gla_core.dispatch("simple_gla", q, k, v, g=g)
    """
    for op, name in implementations.items():
        if op not in OPS:
            raise UnknownOpError(f"use(): expected op names from {list(OPS)}, got {op!r}")
        if not isinstance(name, str):
            raise InvalidArgumentError(f"use({op}=...): expected an implementation name, got {name!r}")
    if backend is not None and backend not in BACKENDS:
        raise InvalidArgumentError(f"use(backend=...): expected one of {sorted(BACKENDS)}, got {backend!r}")
    if interpret is not None and not isinstance(interpret, bool):
        raise InvalidArgumentError(f"use(interpret=...): expected a bool, got {interpret!r}")
    outer = current()
    merged = Overrides(
        implementations=MappingProxyType({**outer.implementations, **implementations}),
        backend=backend if backend is not None else outer.backend,
        interpret=interpret if interpret is not None else outer.interpret,
    )
    token = _ACTIVE.set(merged)
    try:
        yield merged
    finally:
        _ACTIVE.reset(token)


def env_variable(op: str) -> str:
    """The environment variable that forces an implementation of `op`."""
    return f"GLA_IMPL_{op.upper()}"


def forced_implementation(op: str) -> tuple[str, str] | None:
    """The implementation forced for `op` by `use()` or the environment, with its source."""
    name = current().implementations.get(op)
    if name is not None:
        return name, f"gla_core.use({op}={name!r})"
    name = os.environ.get(env_variable(op), "").strip()
    if name:
        return name, f"{env_variable(op)}={name}"
    return None
