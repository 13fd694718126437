"""Overrides that change dispatch without code changes.

`gla_core.use(simple_gla="chunk", backend="tpu", interpret=True)` is a context manager
(nestable, thread-local); `GLA_IMPL_<OP>=name` environment variables force an implementation
per op. Precedence: `impl=` on the call, then `use()`, then the environment, then priority.

Dispatch runs when a function is traced, so a jitted function would keep the implementation it
was first traced with. The active `use()` overrides are therefore part of JAX's jit cache key
(a `jax.make_user_context`): calling a jitted function inside another `use()` block retraces it,
and the override takes effect (or raises, e.g. for an unknown implementation). Environment
variables are read at trace time: set them before the process starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping

import jax

from gla_core.errors import InvalidArgumentError, UnknownOpError
from gla_core.records import BACKENDS, OPS


@dataclasses.dataclass(frozen=True)
class Overrides:
    """The active overrides: forced implementation per op, target backend, interpret mode.

    Hashable (it is part of JAX's jit cache key): `implementations` is a sorted tuple of
    (op, implementation name) pairs; `forced(op)` reads it.
    """

    implementations: tuple[tuple[str, str], ...] = ()
    backend: str | None = None
    interpret: bool | None = None

    def forced(self, op: str) -> str | None:
        """The implementation forced for `op`, or None."""
        return dict(self.implementations).get(op)

    def merged(self, implementations: Mapping[str, str], backend: str | None, interpret: bool | None) -> Overrides:
        """These overrides with the given ones on top."""
        return Overrides(
            implementations=tuple(sorted({**dict(self.implementations), **implementations}.items())),
            backend=backend if backend is not None else self.backend,
            interpret=interpret if interpret is not None else self.interpret,
        )


NO_OVERRIDES = Overrides()
# Created once at import (creating user contexts is not thread-safe); thread-local values.
_ACTIVE = jax.make_user_context(default_value=NO_OVERRIDES)


def current() -> Overrides:
    """The overrides set by the innermost active `use()` of this thread."""
    return _ACTIVE.value


@contextlib.contextmanager
def use(*, backend: str | None = None, interpret: bool | None = None, **implementations: str) -> Iterator[Overrides]:
    """Overrides dispatch inside a `with` block (also for jitted functions called inside it).

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
    merged = current().merged(implementations, backend, interpret)
    with _ACTIVE(merged):
        yield merged


def env_variable(op: str) -> str:
    """The environment variable that forces an implementation of `op`."""
    return f"GLA_IMPL_{op.upper()}"


def forced_implementation(op: str) -> tuple[str, str] | None:
    """The implementation forced for `op` by `use()` or the environment, with its source."""
    name = current().forced(op)
    if name is not None:
        return name, f"gla_core.use({op}={name!r})"
    name = os.environ.get(env_variable(op), "").strip()
    if name:
        return name, f"{env_variable(op)}={name}"
    return None
