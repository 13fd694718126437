"""Fixtures for gla-core tests: a registry holding fake implementations only."""

from __future__ import annotations

import sys
import types
import zlib
from importlib import metadata

import jax.numpy as jnp
import pytest

from gla_core import Implementation, hookimpl
from gla_core.registry import ENTRY_POINT_GROUP, Registry, reset_default_registry

ALL_BACKENDS = frozenset({"cpu", "gpu", "tpu"})


def name_code(name: str) -> int:
    """The int32 a fake implementation named `name` returns (implementations run jitted, so they
    return arrays, not strings)."""
    return zlib.crc32(name.encode()) % 2**31


def fake_name(result) -> str:
    """The name of the fake implementation that returned `result` (see `name_code`)."""
    return _NAMES[int(result)]


@pytest.fixture
def ran():
    """`ran(result)`: the name of the fake implementation that returned `result`."""
    return fake_name


_NAMES: dict[int, str] = {}


def make_fake_impl(name: str, priority: int, op: str = "simple_gla", **fields) -> Implementation:
    """An implementation whose fn returns `name_code(name)`, so tests can see who ran (`ran`)."""
    fields.setdefault("backends", ALL_BACKENDS)
    fields.setdefault("package", "fake-package")
    code = name_code(name)
    _NAMES[code] = name
    return Implementation(op=op, name=name, fn=lambda args: jnp.int32(code), priority=priority, **fields)


def make_plugin(*implementations: Implementation, name: str = "fake_plugin") -> types.ModuleType:
    """A plugin module whose hook returns `implementations`."""
    module = types.ModuleType(name)

    @hookimpl
    def gla_implementations():
        return list(implementations)

    module.gla_implementations = gla_implementations
    return module


@pytest.fixture
def fake_impl():
    """Factory `fake_impl(name, priority, op="simple_gla", **fields)` of implementations returning their name."""
    return make_fake_impl


@pytest.fixture
def plugin_of():
    """Factory `plugin_of(*implementations, name=...)` of plugin modules."""
    return make_plugin


@pytest.fixture
def restore_registry():
    """Reloads the process-wide registry from entry points after the test."""
    yield
    reset_default_registry(None)


@pytest.fixture
def install_registry(restore_registry):
    """Installs a registry built from given plugins as the process-wide one; restores after."""

    def install(*plugins: types.ModuleType) -> Registry:
        registry = Registry()
        for plugin in plugins:
            registry.register(plugin)
        reset_default_registry(registry)
        return registry

    return install


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No override from the developer's shell leaks into a test."""
    for name in ("GLA_PLUGINS", "GLA_INTERPRET", "GLA_DETECT_RACES"):
        monkeypatch.delenv(name, raising=False)
    for op in ("SIMPLE_GLA", "GLA", "KDA", "KDA_GATE"):
        monkeypatch.delenv(f"GLA_IMPL_{op}", raising=False)


@pytest.fixture
def fake_entry_points(monkeypatch, tmp_path):
    """Replaces the `gla` entry points by modules written to a temporary directory."""

    def install(**modules: str) -> None:
        points = []
        for name, source in modules.items():
            module_name = f"gla_fake_plugin_{name}"
            (tmp_path / f"{module_name}.py").write_text(source)
            points.append(metadata.EntryPoint(name=name, value=module_name, group=ENTRY_POINT_GROUP))
            monkeypatch.delitem(sys.modules, module_name, raising=False)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setattr(
            metadata, "entry_points", lambda group=None: [p for p in points if group in (None, p.group)]
        )

    return install


_GOOD_PLUGIN = """
from gla_core import Implementation, hookimpl

@hookimpl
def gla_implementations():
    return [Implementation(op="simple_gla", name="{name}", fn=lambda args: args.q.sum(), priority={priority},
                           backends={{"cpu"}}, package="{name}-package")]
"""


@pytest.fixture
def good_plugin():
    """Source of a plugin module registering one cpu implementation `name` of simple_gla."""
    return lambda name, priority: _GOOD_PLUGIN.format(name=name, priority=priority)
