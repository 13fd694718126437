"""Overrides that change dispatch without code changes.

`gla_core.use(simple_gla="chunk", backend="tpu", interpret=True, chip="v6e")` is a context manager
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
from typing import Any

import jax

from gla_core.errors import InvalidArgumentError
from gla_core.options import check_impl_options
from gla_core.records import BACKENDS
from gla_core.registry import default_registry
from gla_core.tuning import check_chip


@dataclasses.dataclass(frozen=True)
class Overrides:
    """The active overrides: forced implementation (and its options) per op, target backend,
    interpret mode, target TPU chip (for its per-chip option defaults, `gla_core.tuning`).

    Hashable (it is part of JAX's jit cache key): `implementations` is a sorted tuple of
    (op, implementation name, sorted option pairs); `forced(op)` and `forced_options(op)` read it.
    """

    implementations: tuple[tuple[str, str, tuple[tuple[str, Any], ...]], ...] = ()
    backend: str | None = None
    interpret: bool | None = None
    chip: str | None = None

    def forced(self, op: str) -> str | None:
        """The implementation forced for `op`, or None."""
        return next((name for o, name, _ in self.implementations if o == op), None)

    def forced_options(self, op: str) -> dict[str, Any]:
        """The options given with the implementation forced for `op`."""
        return next((dict(options) for o, _, options in self.implementations if o == op), {})

    def merged(
        self,
        implementations: Mapping[str, tuple[str, dict]],
        backend: str | None,
        interpret: bool | None,
        chip: str | None = None,
    ) -> Overrides:
        """These overrides with the given ones (op -> (name, options)) on top."""
        table = {op: (name, options) for op, name, options in self.implementations}
        table.update({op: (name, tuple(sorted(options.items()))) for op, (name, options) in implementations.items()})
        return Overrides(
            implementations=tuple(sorted((op, name, options) for op, (name, options) in table.items())),
            backend=backend if backend is not None else self.backend,
            interpret=interpret if interpret is not None else self.interpret,
            chip=chip if chip is not None else self.chip,
        )


NO_OVERRIDES = Overrides()
# Created once at import (creating user contexts is not thread-safe); thread-local values.
_ACTIVE = jax.make_user_context(default_value=NO_OVERRIDES)


def current() -> Overrides:
    """The overrides set by the innermost active `use()` of this thread."""
    return _ACTIVE.value


@contextlib.contextmanager
def use(
    *, backend: str | None = None, interpret: bool | None = None, chip: str | None = None, **implementations: Any
) -> Iterator[Overrides]:
    """Overrides dispatch inside a `with` block (also for jitted functions called inside it).

    Args:
      backend: target backend ("cpu", "gpu", "tpu"). "tpu" on a host without a TPU lets
        Pallas implementations be chosen so they can be lowered with
        `jax.export(..., platforms=["tpu"])` or compiled for compile-only TPU devices.
      interpret: run Pallas TPU kernels in TPU interpret mode (off-TPU testing).
      chip: the TPU chip calls are traced for ("v5e", "v6e", "v7x"): options a call does not set
        take that chip's defaults (`gla_core.tuning`). Default: the chip of JAX's first device
        if it is a TPU (compile-only devices need it said).
      **implementations: op name to implementation name, e.g. `simple_gla="chunk"`, or to
        (name, options), e.g. `simple_gla=("fused_chunk", {"block_tokens": 256})`.

    Example:
      >>> with gla_core.use(simple_gla="xla"):
      ...     o, _ = gla_core.dispatch("simple_gla", q, k, v, g=g)
    """
    forced = {}
    for op, choice in implementations.items():
        default_registry().op(op)  # UnknownOpError naming the installed ops
        name, options = _implementation_choice(op, choice)
        forced[op] = (name, check_impl_options({name: options})[name])
    if backend is not None and backend not in BACKENDS:
        raise InvalidArgumentError(f"use(backend=...): expected one of {sorted(BACKENDS)}, got {backend!r}")
    if interpret is not None and not isinstance(interpret, bool):
        raise InvalidArgumentError(f"use(interpret=...): expected a bool, got {interpret!r}")
    if chip is not None:
        check_chip(chip, "use(chip=...)")
    merged = current().merged(forced, backend, interpret, chip)
    with _ACTIVE(merged):
        yield merged


def _implementation_choice(op: str, choice: Any) -> tuple[str, Any]:
    """`use(op=choice)`: a name, or a (name, options) pair."""
    if isinstance(choice, str):
        return choice, {}
    if isinstance(choice, tuple) and len(choice) == 2 and isinstance(choice[0], str):
        return choice
    raise InvalidArgumentError(f"use({op}=...): expected an implementation name or (name, options), got {choice!r}")


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
