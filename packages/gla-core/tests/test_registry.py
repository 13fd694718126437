"""Registration rules and entry-point discovery with fault isolation."""

from __future__ import annotations

import pytest

from gla_core import hookimpl
from gla_core.errors import RegistrationError
from gla_core.registry import Registry, default_registry, reset_default_registry


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
    registry.register(plugin_of(fake_impl("x", 5), fake_impl("x", 5, op="kda")))
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
    registry.load_entry_points()
    assert [i.name for i in registry.implementations()] == ["good"]
    (failure,) = registry.failures
    assert failure.plugin == "broken"
    assert "import failed" in failure.error and "libfoo.so" in failure.error


def test_plugin_that_conflicts_is_reported_and_the_others_load(fake_entry_points, good_plugin):
    fake_entry_points(
        first=good_plugin(name="first", priority=7),
        second=good_plugin(name="second", priority=7),
    )
    registry = Registry()
    registry.load_entry_points()
    assert [i.name for i in registry.implementations()] == ["first"]
    assert registry.failures[0].plugin == "second" and "ties" in registry.failures[0].error


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
