"""Per-call options of an implementation: tuning knobs (chunk and block sizes, chunks per grid step)
that an implementation declares, validates and reports, and callers may set per call.

An implementation lists its `Option`s; a call gives values with
`dispatch(..., impl_options={"fused_chunk": {"block_tokens": 256}})` (a mapping from implementation
name to its options, so one call can carry options for every implementation it may end up on) or
`gla_core.use(simple_gla=("fused_chunk", {"block_tokens": 256}))`. Only the chosen implementation's
options are checked and passed on, as `arguments.options` (an `ImplOptions`, hashable: it is
static under `jax.jit`); `explain` shows them. Options the call does not set take the per-chip
defaults of `gla_core.tuning` for the chip the call is traced for, else the declared default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from gla_core.errors import InvalidArgumentError, UnknownArgumentError


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of an implementation.

    Attributes:
      name: the option's name.
      default: its value when the call does not set it.
      check: `check(value) -> normalized value`, raising `InvalidArgumentError` (name, expected,
        received) for a bad one.
      doc: one line for people (`explain`, `gla list`).
      candidates: the values `gla tune` tries for the per-chip table (empty: not tuned).
    """

    name: str
    default: Any
    check: Callable[[Any], Any]
    doc: str = ""
    candidates: tuple = ()


@dataclasses.dataclass(frozen=True)
class ImplOptions:
    """The option values one implementation runs with: sorted (name, value) pairs, which of them
    the call set, which came from the per-chip table of `table_chip` (the others are defaults)."""

    values: tuple[tuple[str, Any], ...] = ()
    given: frozenset[str] = frozenset()
    tuned: frozenset[str] = frozenset()
    table_chip: str | None = None

    def __getitem__(self, name: str) -> Any:
        return dict(self.values)[name]

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.values).get(name, default)

    def describe(self) -> str:
        """ "num_steps=2, block_v=128 (default), block_chunks=8 (v6e table)" for people."""

        def source(name: str) -> str:
            if name in self.given:
                return ""
            return f" ({self.table_chip} table)" if name in self.tuned else " (default)"

        return ", ".join(f"{n}={v!r}{source(n)}" for n, v in self.values)


NO_OPTIONS = ImplOptions()


def resolve_options(
    implementation,
    given: Mapping[str, Any] | None,
    tuned: Mapping[str, Any] | None = None,
    table_chip: str | None = None,
) -> ImplOptions:
    """The options `implementation` runs with: its defaults, overridden by the per-chip `tuned`
    values of `table_chip`'s table, overridden by `given` (all checked)."""
    declared = {option.name: option for option in implementation.options}
    given = dict(given or {})
    unknown = sorted(set(given) - set(declared))
    if unknown:
        raise UnknownArgumentError(
            f"impl_options: {implementation.op} implementation {implementation.name!r} has no option "
            f"{', '.join(map(repr, unknown))}; its options: {sorted(declared) or 'none'}"
        )
    tuned = {name: value for name, value in (tuned or {}).items() if name in declared and name not in given}
    values = {}
    for name, option in declared.items():
        if name in given:
            values[name] = option.check(given[name])
        elif name in tuned:
            try:
                values[name] = option.check(tuned[name])
            except InvalidArgumentError as error:
                where = f"{table_chip} table of {implementation.op}/{implementation.name}"
                raise InvalidArgumentError(f"{where} (gla_core.tuning): {error}") from None
        else:
            values[name] = option.default
    return ImplOptions(tuple(sorted(values.items())), frozenset(given), frozenset(tuned), table_chip if tuned else None)


def check_impl_options(value: Any) -> dict[str, dict[str, Any]]:
    """`impl_options` of a call: a mapping from implementation name to a mapping of options."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(
        isinstance(name, str) and isinstance(options, Mapping) for name, options in value.items()
    ):
        raise InvalidArgumentError(
            "impl_options: expected a mapping from implementation name to its options, e.g. "
            f'{{"fused_chunk": {{"block_tokens": 256}}}}, got {value!r}'
        )
    return {name: dict(options) for name, options in value.items()}


def positive_int(name: str, allowed: tuple[int, ...] | None = None) -> Callable[[Any], int]:
    """A `check` for an integer option (optionally one of `allowed`)."""

    def check(value: Any) -> int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        if not ok or (allowed is not None and value not in allowed):
            expected = f"one of {allowed}" if allowed is not None else "a positive int"
            raise InvalidArgumentError(f"{name}: expected {expected}, got {value!r}")
        return int(value)

    return check


def multiple_of(name: str, base: int) -> Callable[[Any], int]:
    """A `check` for an integer option that must be a positive multiple of `base` (e.g. 128 lanes)."""

    def check(value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % base:
            raise InvalidArgumentError(f"{name}: expected a positive multiple of {base}, got {value!r}")
        return int(value)

    return check
