"""`dispatch` and `explain`: validate a request, choose an implementation, run it."""

from __future__ import annotations

from typing import Any

from gla_core import overrides
from gla_core.backend import backend, interpret_default
from gla_core.errors import InvalidArgumentError
from gla_core.ops import SIGNATURES
from gla_core.records import Implementation
from gla_core.registry import default_registry
from gla_core.resolution import Resolution, resolve
from gla_core.validation import validate


def _forced(op: str, impl: str | None) -> tuple[str, str] | None:
    if impl is not None:
        if not isinstance(impl, str):
            raise InvalidArgumentError(f"impl: expected an implementation name, got {impl!r}")
        return impl, f"impl={impl!r}"
    return overrides.forced_implementation(op)


def _plan(op: str, arrays: tuple, kwargs: dict[str, Any], impl: str | None):
    call, arguments = validate(op, arrays, kwargs, backend=backend(), interpret=interpret_default())
    resolution = resolve(call, default_registry().implementations(op), _forced(op, impl))
    return resolution, arguments


def dispatch(op: str, *arrays: Any, impl: str | None = None, **kwargs: Any) -> Any:
    """Runs `op` with the best implementation for this call and backend.

    Args:
      op: "simple_gla", "gla", "kda" or "kda_gate".
      *arrays: q, k, v (kda_gate: g).
      impl: force an implementation by name; raises with its reason if it declines.
      **kwargs: the op's keyword arguments by FLA's names (see `gla_core.ops`), plus
        `interpret` to run Pallas TPU kernels in TPU interpret mode.

    Returns:
      `(o, final_state)` for the attention ops (`final_state` is None unless
      `output_final_state=True`); the gate `[B, T, HV, K]` for kda_gate.

    Example:
      >>> o, ht = gla_core.dispatch("simple_gla", q, k, v, g=g, output_final_state=True)
    """
    resolution, arguments = _plan(op, arrays, kwargs, impl)
    chosen = resolution.chosen()
    positional = [arguments.pop(name) for name in SIGNATURES[op].arrays]
    return chosen.fn(*positional, **arguments)


def explain(op: str, *arrays: Any, impl: str | None = None, **kwargs: Any) -> Resolution:
    """Every candidate for this call, accepted or declined with its reason, and the winner.

    Takes the same arguments as `dispatch`; arrays may be `jax.ShapeDtypeStruct`s.
    `print(explain(...))` shows a table.
    """
    resolution, _ = _plan(op, arrays, kwargs, impl)
    return resolution


def first_accepting(op: str, family: tuple[str, ...], *arrays: Any, **kwargs: Any) -> str:
    """The first implementation named in `family` that accepts this call.

    For functions that pin an implementation family (FLA-named entry points): overrides
    (`impl=`, `use()`, `GLA_IMPL_<OP>`) do not apply. The last name is the fallback; it is
    forced while resolving, so it raises `ImplementationDeclinedError` if it declines too.
    Arrays may be `jax.ShapeDtypeStruct`s.
    """
    resolution = explain(op, *arrays, impl=family[-1], **kwargs)
    accepted = {candidate.implementation.name for candidate in resolution.candidates if candidate.accepted}
    return next(name for name in family if name in accepted or name == family[-1])


def implementations(op: str | None = None) -> tuple[Implementation, ...]:
    """Registered implementations (of `op` when given), highest priority first."""
    return default_registry().implementations(op)
