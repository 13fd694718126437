"""Registration rules and entry-point discovery with fault isolation."""

from __future__ import annotations

from importlib import metadata

import pytest

from gla_core import hookimpl
from gla_core.errors import PluginWarning, RegistrationError
from gla_core.registry import ENTRY_POINT_GROUP, Registry, default_registry, reset_default_registry


def test_registered_implementations_are_listed_by_op_then_priority(fake_impl, plugin_of):
    registry = Registry()
    registry.register(plugin_of(fake_impl("a", 1), fake_impl("b", 5), fake_impl("c", 3, op="gla")))
    assert [(i.op, i.name) for i in registry.implementations()] == [
        ("simple_gla", "b"),
        ("simple_gla", "a"),
        ("gla", "c"),
    ]
    assert [i.name for i in registry.implementations("gla")] == ["c"]


def test_priority_tie_for_one_op_is_rejected(fake_impl, plugin_of):
    registry = Registry()
    registry.register(plugin_of(fake_impl("first", 5), name="one"))
    with pytest.raises(RegistrationError, match="priority 5 ties with simple_gla/first"):
        registry.register(plugin_of(fake_impl("second", 5), name="two"))
    assert [i.name for i in registry.implementations()] == ["first"]


def test_equal_priorities_for_different_ops_are_fine(fake_impl, plugin_of):
    registry = Registry()
    registry.register(plugin_of(fake_impl("x", 5), fake_impl("x", 5, op="gla")))
    assert len(registry.implementations()) == 2


def test_duplicate_name_for_one_op_is_rejected(fake_impl, plugin_of):
    registry = Registry()
    with pytest.raises(RegistrationError, match="name already registered"):
        registry.register(plugin_of(fake_impl("same", 1), fake_impl("same", 2)))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(name="x", priority=1, op="attention"), "op must be one of"),
        (dict(name="", priority=1), "name must be a non-empty string"),
        (dict(name="x", priority=1.5), "priority must be an int"),
        (dict(name="x", priority=1, backends={"fpga"}), "backends must be a non-empty subset"),
    ],
)
def test_invalid_records_are_rejected(fields, message, fake_impl, plugin_of):
    with pytest.raises(RegistrationError, match=message):
        Registry().register(plugin_of(fake_impl(**fields)))


def test_non_record_is_rejected(plugin_of):
    with pytest.raises(RegistrationError, match="expected Implementation records"):
        Registry().register(plugin_of("not a record"))


def test_rejected_plugin_adds_nothing(fake_impl, plugin_of):
    registry = Registry()
    with pytest.raises(RegistrationError):
        registry.register(plugin_of(fake_impl("good", 1), fake_impl("bad", 2, op="nope")))
    assert registry.implementations() == ()


def test_hook_that_raises_is_a_registration_error():
    class Broken:
        @hookimpl
        def gla_implementations(self):
            raise RuntimeError("boom")

    with pytest.raises(RegistrationError, match="raised RuntimeError: boom"):
        Registry().register(Broken())


# ------------------------------------------------------------------ entry points


def test_plugin_that_raises_on_import_is_reported_and_skipped(fake_entry_points, good_plugin):
    fake_entry_points(
        good=good_plugin(name="good", priority=1),
        broken="raise ImportError('missing native library libfoo.so')",
    )
    registry = Registry()
    with pytest.warns(PluginWarning, match="libfoo.so"):
        registry.load_entry_points()
    assert [i.name for i in registry.implementations()] == ["good"]
    (failure,) = registry.failures
    assert failure.plugin == "broken"
    assert "import failed" in failure.error and "libfoo.so" in failure.error


def test_conflicting_third_party_records_are_all_rejected_whatever_the_load_order(fake_entry_points, good_plugin):
    fake_entry_points(
        first=good_plugin(name="first", priority=7),
        second=good_plugin(name="second", priority=7),
        third=good_plugin(name="third", priority=8),
    )
    with pytest.warns(PluginWarning) as warned:
        registry = Registry()
        registry.load_entry_points()
    assert [i.name for i in registry.implementations()] == ["third"]
    assert sorted(f.plugin for f in registry.failures) == ["first", "second"]
    assert all("priority 7" in f.error and "conflicts" in f.error for f in registry.failures)
    assert len(warned) == 2


def test_an_impostor_cannot_knock_out_a_first_party_package(fake_entry_points, good_plugin, monkeypatch):
    """A plugin sorting before gla-simple registers simple_gla/xla and ties gla-simple's priority 50:
    only the impostor's records are rejected, named after their plugin; gla-simple loads whole."""
    real = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    simple = next(ep for ep in real if ep.name == "simple")
    fake_entry_points(
        a_impostor=IMPOSTOR,
        ok=good_plugin(name="harmless", priority=3),
    )
    faked = metadata.entry_points(group=ENTRY_POINT_GROUP)
    monkeypatch.setattr(metadata, "entry_points", lambda group=None: [*faked, simple])
    with pytest.warns(PluginWarning, match="a_impostor"):
        registry = Registry()
        registry.load_entry_points()
    simple_gla = {i.name: i for i in registry.implementations("simple_gla")}
    assert simple_gla["xla"].package == "gla-simple" and simple_gla["xla"].fn is not impostor_fn
    assert {"chunk", "recurrent", "harmless"} <= set(simple_gla)
    assert "impostor_tie" not in simple_gla
    assert {f.plugin for f in registry.failures} == {"a_impostor"}
    messages = " ".join(f.error for f in registry.failures)
    assert "simple_gla/xla" in messages and "priority 50" in messages


def impostor_fn(*arrays, **kwargs):
    return "impostor"


IMPOSTOR = """
from gla_core import Implementation, hookimpl

def _run(*arrays, **kwargs):
    return "impostor"

@hookimpl
def gla_implementations():
    common = dict(op="simple_gla", fn=_run, backends={"cpu"}, package="gla-simple")
    return [Implementation(name="xla", priority=999, **common),
            Implementation(name="impostor_tie", priority=50, **common)]
"""


def test_unknown_names_in_gla_plugins_are_warned_about(fake_entry_points, good_plugin, monkeypatch):
    fake_entry_points(one=good_plugin(name="one", priority=1))
    with pytest.warns(PluginWarning, match="not installed: nope"):
        Registry().load_entry_points(["one", "nope"])


def test_gla_plugins_restricts_which_entry_points_load(fake_entry_points, good_plugin, monkeypatch, restore_registry):
    fake_entry_points(
        one=good_plugin(name="one", priority=1),
        two=good_plugin(name="two", priority=2),
    )
    monkeypatch.setenv("GLA_PLUGINS", "one")
    reset_default_registry(None)
    registry = default_registry()
    assert [i.name for i in registry.implementations()] == ["one"]
    assert registry.skipped == ("two",)
