"""The plugin registry: discovers ops and implementations through pluggy and keeps them.

Plugins are modules registered under the entry-point group `gla`. Loading runs in two passes:
every plugin's ops (`gla_ops`, gla-core's own `attention_ops` first), then every plugin's
implementations (`gla_implementations`). Each entry point is loaded on its own: one that fails
to import or raises in a hook is skipped whole; an invalid record is skipped alone; an
implementation of an op no installed plugin defines is set aside (`inapplicable`). Records that
conflict (same op and name, or same op and priority) are settled independently of load order:
the implementations of gla's own distributions (`FIRST_PARTY_DISTRIBUTIONS`) are never
displaced by another plugin's, and conflicting records of other plugins are all rejected. Every
skipped plugin or record is reported in `failures` (shown by `gla list`) and warned about
(`PluginWarning`). `GLA_PLUGINS` (comma-separated entry-point names) restricts which entry
points load. Every implementation runs jitted (`runner`).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import warnings
from collections.abc import Iterable
from importlib import metadata

import jax
import pluggy

from gla_core import attention_ops, hookspecs
from gla_core.errors import PluginWarning, RegistrationError, UnknownOpError
from gla_core.ops import OpSpec
from gla_core.records import BACKENDS, FIRST_PARTY_DISTRIBUTIONS, Implementation

ENTRY_POINT_GROUP = "gla"
PLUGINS_ENV = "GLA_PLUGINS"


@dataclasses.dataclass(frozen=True)
class PluginFailure:
    """A plugin that was skipped and why."""

    plugin: str
    error: str


class Registry:
    """Ops and implementations contributed by plugins, with the failures met while loading them."""

    def __init__(self) -> None:
        self._manager = pluggy.PluginManager(hookspecs.PROJECT)
        self._manager.add_hookspecs(hookspecs)
        self._ops: dict[str, OpSpec] = {}
        self._op_plugins: dict[str, str] = {}
        self._implementations: list[Implementation] = []
        self._runners: dict[tuple[str, str], object] = {}
        self._failures: list[PluginFailure] = []
        self._skipped: list[str] = []
        self._inapplicable: list[tuple[str, Implementation]] = []
        self.register(attention_ops, name="gla_core.attention_ops")

    # ----------------------------------------------------------------- loading

    def register(self, plugin: object, name: str | None = None) -> list[Implementation]:
        """Registers one plugin (a module or object with `@hookimpl` functions): its ops, then its
        implementations.

        Returns the implementations it added. Raises `RegistrationError` when a hook raises or
        returns invalid or conflicting records (including an implementation of an unknown op);
        the plugin is then not kept.
        """
        name = name or getattr(plugin, "__name__", None) or repr(plugin)
        if self._manager.is_registered(plugin) or self._manager.get_plugin(name) is not None:
            raise RegistrationError(f"plugin {name!r} is already registered")
        self._manager.register(plugin, name=name)
        try:
            ops = self._hook_ops(plugin, name)
            for spec in ops:
                self._check_op(spec, name, self._ops)
            known = {**self._ops, **{spec.name: spec for spec in ops}}
            added = self._collect(plugin, name, known)
        except Exception:
            self._manager.unregister(plugin)
            raise
        for spec in ops:
            self._add_op(spec, name)
        for record in added:
            self._add(record)
        return added

    def load_entry_points(self, allowed: Iterable[str] | None = None) -> None:
        """Loads every entry point of group `gla` (only those in `allowed` when given)."""
        entry_points = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
        if allowed is not None:
            allowed = set(allowed)
            unknown = sorted(allowed - {entry_point.name for entry_point in entry_points})
            if unknown:
                installed = ", ".join(ep.name for ep in entry_points) or "none"
                warnings.warn(
                    f"{PLUGINS_ENV} names plugins that are not installed: {', '.join(unknown)} "
                    f"(installed: {installed})",
                    PluginWarning,
                    stacklevel=2,
                )
        loaded = []
        for entry_point in entry_points:
            if allowed is not None and entry_point.name not in allowed:
                self._skipped.append(entry_point.name)
                continue
            plugin = self._load(entry_point)
            if plugin is not None:
                loaded.append((entry_point, plugin))
        for entry_point, plugin in loaded:  # pass 1: ops
            try:
                ops = self._hook_ops(plugin, entry_point.name)
            except RegistrationError as error:
                self._fail(entry_point.name, str(error))
                continue
            for spec in ops:
                try:
                    self._check_op(spec, entry_point.name, self._ops)
                except RegistrationError as error:
                    self._fail(entry_point.name, str(error))
                    continue
                self._add_op(spec, entry_point.name)
        offers: list[_Offer] = []
        for entry_point, plugin in loaded:  # pass 2: implementations
            offers.extend(self._offers_of(entry_point, plugin))
        for offer, reason in _settle_conflicts(offers, self._implementations):
            if reason is None:
                self._add(offer.record)
            else:
                self._fail(offer.plugin, f"implementation {offer.record.op}/{offer.record.name} rejected: {reason}")

    def _load(self, entry_point):
        """The plugin module of an entry point, registered with pluggy; None (reported) when it fails."""
        try:
            plugin = entry_point.load()
            self._manager.register(plugin, name=entry_point.name)
        except Exception as error:
            self._fail(entry_point.name, f"import failed: {type(error).__name__}: {error}")
            return None
        return plugin

    def _offers_of(self, entry_point, plugin) -> list[_Offer]:
        """The valid records of one loaded entry point; hook failures and bad records are reported."""
        name = entry_point.name
        try:
            records = self._hook_records(plugin, name)
        except Exception as error:
            self._fail(name, f"{type(error).__name__}: {error}")
            return []
        first_party = _distribution_name(entry_point) in FIRST_PARTY_DISTRIBUTIONS
        offers = []
        for record in records:
            if isinstance(record, Implementation) and record.op not in self._ops:
                self._inapplicable.append((name, record))
                continue
            try:
                self._check(record, name, [], self._ops)
            except RegistrationError as error:
                self._fail(name, str(error))
                continue
            offers.append(_Offer(name, record, first_party))
        return offers

    def _fail(self, plugin: str, error: str) -> None:
        self._failures.append(PluginFailure(plugin, error))
        warnings.warn(f"gla plugin {plugin!r} skipped: {error}", PluginWarning, stacklevel=3)

    def _add_op(self, spec: OpSpec, plugin: str) -> None:
        self._ops[spec.name] = spec
        self._op_plugins[spec.name] = plugin

    def _add(self, record: Implementation) -> None:
        self._implementations.append(record)
        self._runners[(record.op, record.name)] = jax.jit(record.fn)

    def _hook_results(self, hook_name: str, plugin: object, name: str) -> list:
        hooks = [h for h in getattr(self._manager.hook, hook_name).get_hookimpls() if h.plugin is plugin]
        results: list = []
        for hook in hooks:
            try:
                returned = hook.function()
            except Exception as error:
                raise RegistrationError(
                    f"plugin {name!r}: {hook_name}() raised {type(error).__name__}: {error}"
                ) from error
            if not isinstance(returned, (list, tuple)):
                raise RegistrationError(
                    f"plugin {name!r}: {hook_name}() must return a list, got {type(returned).__name__}"
                )
            results.extend(returned)
        return results

    def _hook_records(self, plugin: object, name: str) -> list:
        return self._hook_results("gla_implementations", plugin, name)

    def _hook_ops(self, plugin: object, name: str) -> list:
        return self._hook_results("gla_ops", plugin, name)

    def _collect(self, plugin: object, name: str, ops: dict[str, OpSpec]) -> list[Implementation]:
        records = self._hook_records(plugin, name)
        for record in records:
            self._check(record, name, [*self._implementations, *records[: records.index(record)]], ops)
        return records

    def _check_op(self, spec: object, plugin: str, existing: dict[str, OpSpec]) -> None:
        if not isinstance(spec, OpSpec):
            raise RegistrationError(
                f"plugin {plugin!r}: gla_ops() must return OpSpec records, got {type(spec).__name__}"
            )
        if spec.name in existing:
            raise RegistrationError(
                f"plugin {plugin!r}: op {spec.name!r} is already defined by plugin {self._op_plugins[spec.name]!r}"
            )

    @staticmethod
    def _check(record: object, plugin: str, existing: list[Implementation], ops: dict[str, OpSpec]) -> None:
        if not isinstance(record, Implementation):
            raise RegistrationError(f"plugin {plugin!r}: expected Implementation records, got {type(record).__name__}")
        where = f"plugin {plugin!r}, implementation {record.op}/{record.name}"
        if record.op not in ops:
            raise RegistrationError(f"{where}: op must be one of the installed ops {list(ops)}, got {record.op!r}")
        if not record.name or not isinstance(record.name, str):
            raise RegistrationError(f"{where}: name must be a non-empty string, got {record.name!r}")
        if not isinstance(record.priority, int) or isinstance(record.priority, bool):
            raise RegistrationError(f"{where}: priority must be an int, got {record.priority!r}")
        if not record.backends or not record.backends <= BACKENDS:
            raise RegistrationError(
                f"{where}: backends must be a non-empty subset of {sorted(BACKENDS)}, got {sorted(record.backends)}"
            )
        if not callable(record.fn) or not callable(record.supports):
            raise RegistrationError(f"{where}: fn and supports must be callable")
        for other in existing:
            if other.op != record.op:
                continue
            if other.name == record.name:
                raise RegistrationError(
                    f"{where}: name already registered for {record.op} by package {other.package!r}"
                )
            if other.priority == record.priority:
                raise RegistrationError(
                    f"{where}: priority {record.priority} ties with {other.op}/{other.name} "
                    f"from package {other.package!r}; priorities of one op must differ"
                )

    # ----------------------------------------------------------------- queries

    def implementations(self, op: str | None = None) -> tuple[Implementation, ...]:
        """Registered implementations (of `op` when given), highest priority first."""
        order = list(self._ops)
        chosen = [i for i in self._implementations if op is None or i.op == op]
        return tuple(sorted(chosen, key=lambda i: (order.index(i.op), -i.priority)))

    def ops(self) -> tuple[str, ...]:
        """The installed ops, in the order they were defined."""
        return tuple(self._ops)

    def op(self, name: str) -> OpSpec:
        """The spec of op `name`; `UnknownOpError` listing the installed ops when there is none."""
        if name not in self._ops:
            raise UnknownOpError(f"op: expected one of the installed ops {sorted(self._ops)}, got {name!r}")
        return self._ops[name]

    def runner(self, implementation: Implementation):
        """`jax.jit(implementation.fn)`: every implementation runs on its arguments record this way."""
        return self._runners[(implementation.op, implementation.name)]

    @property
    def inapplicable(self) -> tuple[tuple[str, Implementation], ...]:
        """(plugin, implementation) of ops that no installed plugin defines; not registered."""
        return tuple(self._inapplicable)

    @property
    def failures(self) -> tuple[PluginFailure, ...]:
        """Plugins that failed to load, with the reason."""
        return tuple(self._failures)

    @property
    def skipped(self) -> tuple[str, ...]:
        """Entry points not loaded because `GLA_PLUGINS` does not list them."""
        return tuple(self._skipped)


@dataclasses.dataclass(frozen=True)
class _Offer:
    """One record offered by an entry point, before conflicts are settled."""

    plugin: str
    record: Implementation
    first_party: bool


def _distribution_name(entry_point) -> str | None:
    name = getattr(getattr(entry_point, "dist", None), "name", None)
    return None if name is None else name.lower().replace("_", "-")


def _settle_conflicts(offers: list[_Offer], registered: list[Implementation]) -> list[tuple[_Offer, str | None]]:
    """Each offer with None (accepted) or the reason it is rejected, independent of their order.

    Two records conflict when they serve one op with the same name or the same priority. Already
    registered records and gla's own (first-party) records win against the others; among the
    others, every record of a conflict is rejected (no plugin wins by loading first).
    """
    rejected: dict[int, str] = {}
    for what in ("name", "priority"):
        groups: dict = collections.defaultdict(list)
        for index, offer in enumerate(offers):
            if index not in rejected:
                groups[(offer.record.op, getattr(offer.record, what))].append(index)
        for (op, value), members in groups.items():
            fixed = [r for r in registered if (r.op, getattr(r, what)) == (op, value)]
            if len(members) + len(fixed) < 2:
                continue
            first_party = [i for i in members if offers[i].first_party]
            keep = first_party[0] if not fixed and len(first_party) == 1 else None
            settled = "gla's own implementations take precedence" if keep is not None or fixed else "all rejected"
            for index in members:
                if index == keep:
                    continue
                others = [f"{r.op}/{r.name} (registered, package {r.package!r})" for r in fixed]
                others += [
                    f"{op}/{offers[i].record.name} of plugin {offers[i].plugin!r}" for i in members if i != index
                ]
                rejected[index] = f"its {what} {value!r} for {op} conflicts with {', '.join(others)} ({settled})"
    return [(offer, rejected.get(index)) for index, offer in enumerate(offers)]


_lock = threading.Lock()
_default: Registry | None = None


def allowed_plugins() -> list[str] | None:
    """Entry-point names listed in `GLA_PLUGINS`, or None when it is unset (load all)."""
    raw = os.environ.get(PLUGINS_ENV)
    if raw is None or not raw.strip():
        return None
    return [name.strip() for name in raw.split(",") if name.strip()]


def default_registry() -> Registry:
    """The process-wide registry, loaded from entry points on first use."""
    global _default
    with _lock:
        if _default is None:
            registry = Registry()
            registry.load_entry_points(allowed_plugins())
            _default = registry
        return _default


def reset_default_registry(registry: Registry | None = None) -> None:
    """Replaces the process-wide registry (None: reload from entry points on next use)."""
    global _default
    with _lock:
        _default = registry
