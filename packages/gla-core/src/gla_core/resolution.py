"""Choosing an implementation for a call: a pure function of (call, implementations, override).

Nothing here touches arrays, plugins or the environment, so every rule can be unit-tested
with hand-built `Call` and `Implementation` records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from gla_core.errors import ImplementationDeclinedError, NoImplementationError, UnknownImplementationError
from gla_core.options import NO_OPTIONS, ImplOptions
from gla_core.records import Call, Implementation

INTERPRET_HINT = (
    "to run it here in TPU interpret mode pass interpret=True, set GLA_INTERPRET=1 "
    "or wrap the call in gla_core.use(interpret=True)"
)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One implementation of the op and its verdict: `reason` is None when it accepts."""

    implementation: Implementation
    reason: str | None

    @property
    def accepted(self) -> bool:
        return self.reason is None


@dataclasses.dataclass(frozen=True)
class Resolution:
    """Every candidate for a call, highest priority first, and the winner (None if none accepts)."""

    call: Call
    candidates: tuple[Candidate, ...]
    winner: Implementation | None
    forced_by: str | None = None
    providers: tuple[str, ...] = ()
    options: ImplOptions = NO_OPTIONS
    among: tuple[str, ...] | None = None

    def chosen(self) -> Implementation:
        """The winner, or `NoImplementationError` listing why each candidate declined."""
        if not self.candidates:
            providers = " or ".join(self.providers)
            raise NoImplementationError(
                f"{self.call.op}: no implementation is registered (is the package that provides it installed? "
                f"pip install {providers or 'a gla plugin for this op'}; `gla list` shows plugins that failed to load)"
            )
        if self.winner is None:
            raise NoImplementationError(
                f"{self.call.op}: no implementation accepts this call ({self.call.describe()}):\n" + self.report()
            )
        return self.winner

    def __str__(self) -> str:
        winner = self.winner.name if self.winner is not None else "none"
        return f"{self.call.describe()}\n{self.report()}\n  chosen: {winner}"

    def report(self) -> str:
        """A table for people: one line per candidate with its verdict."""
        lines = []
        for candidate in self.candidates:
            impl = candidate.implementation
            mark = "*" if impl is self.winner else " "
            verdict = "accepted" if candidate.accepted else f"declined: {candidate.reason}"
            lines.append(f"{mark} {impl.name:<16} priority {impl.priority:>4}  {verdict}")
        if self.forced_by:
            lines.append(f"  (forced by {self.forced_by})")
        if self.among is not None:
            lines.append(f"  (only among {', '.join(self.among)}; overrides do not apply)")
        if self.winner is not None and self.options.values:
            lines.append(f"  options of {self.winner.name}: {self.options.describe()}")
        return "\n".join(lines)


def eligibility(implementation: Implementation, call: Call) -> str | None:
    """None when `implementation` can serve `call`, else the reason it cannot."""
    if call.backend not in implementation.backends and not (implementation.interpretable and call.interpret):
        reason = f"runs on {'/'.join(sorted(implementation.backends))}, the current backend is {call.backend}"
        if implementation.interpretable:
            reason += f"; {INTERPRET_HINT}"
        return reason
    try:
        return implementation.supports(call)
    except Exception as error:  # a plugin bug must not break dispatch for the others
        return f"its supports() check raised {type(error).__name__}: {error}"


def resolve(
    call: Call,
    implementations: Iterable[Implementation],
    forced: tuple[str, str] | None = None,
    providers: tuple[str, ...] = (),
) -> Resolution:
    """Chooses the implementation for `call`.

    Args:
      call: the validated call.
      implementations: every registered implementation (of any op).
      forced: `(name, source)` when an implementation is forced by `impl=`, `use()` or
        the environment; `source` says which, for error messages.
      providers: the distributions that implement the op, named when none is registered.

    Returns:
      The resolution. A forced implementation wins if it accepts; otherwise
      `ImplementationDeclinedError` is raised with its reason. Unforced, the accepting
      implementation with the highest priority wins (None when nobody accepts).
    """
    ranked = sorted((i for i in implementations if i.op == call.op), key=lambda i: -i.priority)
    candidates = tuple(Candidate(impl, eligibility(impl, call)) for impl in ranked)
    if forced is None:
        winner = next((c.implementation for c in candidates if c.accepted), None)
        return Resolution(call, candidates, winner, providers=providers)
    name, source = forced
    match = next((c for c in candidates if c.implementation.name == name), None)
    if match is None:
        known = ", ".join(c.implementation.name for c in candidates) or "none"
        raise UnknownImplementationError(
            f"impl: {call.op} has no implementation {name!r} (requested by {source}); registered: {known}"
        )
    if not match.accepted:
        raise ImplementationDeclinedError(
            f"{call.op}: implementation {name!r} (requested by {source}) declines this call "
            f"({call.describe()}): {match.reason}",
            match.reason,
        )
    return Resolution(call, candidates, match.implementation, forced_by=source, providers=providers)
