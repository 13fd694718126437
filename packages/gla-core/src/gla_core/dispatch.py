"""`dispatch` and `explain`: validate a request, choose an implementation, run it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from gla_core import overrides, tuning
from gla_core.backend import backend, interpret_default
from gla_core.errors import InvalidArgumentError, UnknownImplementationError
from gla_core.options import check_impl_options, resolve_options
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


def _family(op: str, among: Sequence[str], registered: tuple[Implementation, ...]) -> tuple[str, ...]:
    if isinstance(among, str) or not among or not all(isinstance(name, str) for name in among):
        raise InvalidArgumentError(f"among: expected a non-empty sequence of implementation names, got {among!r}")
    names = {i.name for i in registered}
    unknown = [name for name in among if name not in names]
    if unknown:
        raise UnknownImplementationError(
            f"among: {op} has no implementation {', '.join(map(repr, unknown))}; registered: {', '.join(sorted(names))}"
        )
    return tuple(among)


def _plan(
    op: str,
    arrays: tuple,
    kwargs: dict[str, Any],
    impl: str | None,
    among: Sequence[str] | None,
    call_fields: Mapping[str, Any] | None = None,
):
    registry = default_registry()
    spec = registry.op(op)
    impl_options = check_impl_options(kwargs.pop("impl_options", None))
    call, arguments = validate(spec, arrays, kwargs, backend=backend(), interpret=interpret_default())
    if call_fields:
        call = dataclasses.replace(call, **call_fields)
    registered = registry.implementations(op)
    unknown = sorted(set(impl_options) - {i.name for i in registered})
    if unknown:
        raise UnknownImplementationError(f"impl_options: {op} has no implementation {', '.join(map(repr, unknown))}")
    if among is None:
        forced = _forced(op, impl)
        resolution = resolve(call, registered, forced, providers=spec.providers)
    else:
        if impl is not None:
            raise InvalidArgumentError("impl and among: give one (among picks from a family, impl forces one)")
        family = _family(op, among, registered)
        forced = None
        candidates = [i for i in registered if i.name in family]
        resolution = dataclasses.replace(resolve(call, candidates, providers=spec.providers), among=family)
    if resolution.winner is not None:
        from_use = overrides.current().forced_options(op) if forced and forced[1].startswith("gla_core.use") else {}
        given = {**from_use, **impl_options.get(resolution.winner.name, {})}
        tuned, table_chip = tuning.tuned_defaults(op, resolution.winner.name, tuning.target_chip())
        options = resolve_options(resolution.winner, given, tuned, table_chip)
        resolution = dataclasses.replace(resolution, options=options)
    return registry, spec, resolution, arguments


def dispatch(op: str, *arrays: Any, impl: str | None = None, among: Sequence[str] | None = None, **kwargs: Any) -> Any:
    """Runs `op` with the best implementation for this call and backend.

    Args:
      op: an installed op: "simple_gla", "gla", "kda", "kda_gate" (`gla list` shows them).
      *arrays: q, k, v (kda_gate: g).
      impl: force an implementation by name; raises with its reason if it declines.
      among: choose only among these implementations (the highest-priority one that accepts);
        `use()` and `GLA_IMPL_<OP>` overrides do not apply. For functions that pin a family,
        like FLA's `chunk_*` names.
      **kwargs: the op's keyword arguments by FLA's names (see `gla_core.ops`), plus
        `interpret` to run Pallas TPU kernels in TPU interpret mode and `impl_options`, a
        mapping from implementation name to its per-call options (see `gla_core.options`).
        Context parallelism (inside `jax.shard_map` with T sharded over a mesh axis):
        `context_axis`, that axis' name, and `context_exchange`, "all_gather" (default) or
        "ring" (see `gla_core.context_parallel`).

    Returns:
      `(o, final_state)` for the attention ops (`final_state` is None unless
      `output_final_state=True`); the gate `[B, T, HV, K]` for kda_gate. With `context_axis`:
      this device's slice of o and the final state of the whole sequences, on every device.

    Example:
      >>> o, ht = gla_core.dispatch("simple_gla", q, k, v, g=g, output_final_state=True)
    """
    if _context_parallel(kwargs):
        from gla_core.context_parallel.run import dispatch_context_parallel  # it imports this module

        return dispatch_context_parallel(op, arrays, kwargs, impl=impl, among=among)
    return run(op, arrays, kwargs, impl=impl, among=among)


def run(
    op: str,
    arrays: tuple,
    kwargs: dict[str, Any],
    *,
    impl: str | None = None,
    among: Sequence[str] | None = None,
    call_fields: Mapping[str, Any] | None = None,
) -> Any:
    """`dispatch` of one call on this device's arrays; `call_fields` are set on its validated `Call`
    before an implementation is chosen (context parallelism marks its per-device call this way)."""
    registry, spec, resolution, arguments = _plan(op, arrays, kwargs, impl, among, call_fields)
    chosen = resolution.chosen()
    record = spec.arguments(**arguments, options=resolution.options)
    return registry.runner(chosen)(record)


def explain(
    op: str, *arrays: Any, impl: str | None = None, among: Sequence[str] | None = None, **kwargs: Any
) -> Resolution:
    """Every candidate for this call, accepted or declined with its reason, the winner and its options.

    Takes the same arguments as `dispatch`; arrays may be `jax.ShapeDtypeStruct`s.
    `print(explain(...))` shows a table. With `context_axis` (inside `jax.shard_map`), the call
    explained is the one each device runs on its shard.
    """
    if _context_parallel(kwargs):
        from gla_core.context_parallel.run import explain_context_parallel  # it imports this module

        return explain_context_parallel(op, arrays, kwargs, impl=impl, among=among)
    return _plan(op, arrays, kwargs, impl, among)[2]


def resolution_of(
    op: str,
    arrays: tuple,
    kwargs: dict[str, Any],
    *,
    impl: str | None = None,
    among: Sequence[str] | None = None,
    call_fields: Mapping[str, Any] | None = None,
) -> Resolution:
    """`explain` of one call on this device's arrays, with `call_fields` set on its `Call` (as `run`)."""
    return _plan(op, arrays, kwargs, impl, among, call_fields)[2]


def _context_parallel(kwargs: dict[str, Any]) -> bool:
    """Whether the call asks for context parallelism; drops `context_axis=None` (the FLA-named
    functions pass it) and rejects `context_exchange` without an axis."""
    if kwargs.get("context_axis") is not None:
        return True
    kwargs.pop("context_axis", None)
    exchange = kwargs.pop("context_exchange", None)
    if exchange is not None:
        raise InvalidArgumentError(
            f"context_exchange: only used with context_axis (context parallelism), got "
            f"context_exchange={exchange!r} without a context_axis"
        )
    return False


def implementations(op: str | None = None) -> tuple[Implementation, ...]:
    """Registered implementations (of `op` when given), highest priority first."""
    return default_registry().implementations(op)


def ops() -> tuple[str, ...]:
    """The installed ops."""
    return default_registry().ops()


def dispatch_by_name(op: str, arguments: Mapping[str, Any], **how: Any) -> Any:
    """`dispatch(op, ...)` with every argument given by name, for functions with FLA's signatures.

    The op's positional arrays (q, k, v) are taken from `arguments` in order, the rest are passed
    as keywords, with `how` (`impl=`, `among=`) on top. Example, as the first statement of a
    function whose parameters are the op's arguments:
      >>> return dispatch_by_name("simple_gla", locals(), among=("chunk", "xla"))
    """
    keywords = dict(arguments)
    arrays = [keywords.pop(name) for name in default_registry().op(op).arrays]
    return dispatch(op, *arrays, **how, **keywords)
