"""Per-call implementation options (`impl_options=`, `use(op=(name, options))`) and family pinning
(`among=`), end to end with fake implementations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import gla_core
from gla_core.errors import (
    InvalidArgumentError,
    NoImplementationError,
    UnknownArgumentError,
    UnknownImplementationError,
)
from gla_core.kit import Option, multiple_of, positive_int

B, T, H, K, V = 1, 8, 2, 8, 4
TUNABLE_OPTIONS = (
    Option("num_steps", 4, positive_int("num_steps"), "chunks per grid step"),
    Option("block_v", 256, multiple_of("block_v", 128), "largest V tile"),
)


def qkv():
    return jnp.ones((B, T, H, K)), jnp.ones((B, T, H, K)), jnp.ones((B, T, H, V))


@pytest.fixture
def tunable(install_registry, fake_impl, plugin_of):
    """simple_gla with `tunable` (priority 100, two options; its fn returns num_steps * 1000 + block_v)
    and `plain` (priority 50, no options)."""
    tunable = gla_core.Implementation(
        **{
            **fake_impl("tunable", 100).__dict__,
            "options": TUNABLE_OPTIONS,
            "fn": lambda args: jnp.int32(args.options["num_steps"] * 1000 + args.options["block_v"]),
        }
    )
    install_registry(plugin_of(tunable, fake_impl("plain", 50)))


def test_defaults_reach_the_implementation_when_the_call_sets_nothing(tunable):
    assert int(gla_core.dispatch("simple_gla", *qkv())) == 4 * 1000 + 256


def test_per_call_options_reach_the_implementation(tunable):
    result = gla_core.dispatch("simple_gla", *qkv(), impl_options={"tunable": {"num_steps": 2}})
    assert int(result) == 2 * 1000 + 256


def test_options_from_use_reach_the_implementation_and_the_call_wins(tunable):
    with gla_core.use(simple_gla=("tunable", {"num_steps": 1, "block_v": 128})):
        assert int(gla_core.dispatch("simple_gla", *qkv())) == 1 * 1000 + 128
        result = gla_core.dispatch("simple_gla", *qkv(), impl_options={"tunable": {"num_steps": 3}})
        assert int(result) == 3 * 1000 + 128


def test_options_are_static_under_jit(tunable):
    @jax.jit
    def run(q, k, v):
        return gla_core.dispatch("simple_gla", q, k, v, impl_options={"tunable": {"block_v": 512}})

    assert int(run(*qkv())) == 4 * 1000 + 512


def test_explain_shows_the_winners_options_and_which_are_defaults(tunable):
    resolution = gla_core.explain("simple_gla", *qkv(), impl_options={"tunable": {"num_steps": 2}})
    assert resolution.options["num_steps"] == 2 and resolution.options["block_v"] == 256
    assert "options of tunable: block_v=256 (default), num_steps=2" in str(resolution)


def test_options_of_implementations_not_chosen_are_not_applied(tunable):
    resolution = gla_core.explain("simple_gla", *qkv(), impl="plain", impl_options={"tunable": {"num_steps": 2}})
    assert resolution.winner.name == "plain" and resolution.options.values == ()


@pytest.mark.parametrize(
    ("impl_options", "error", "message"),
    [
        ({"tunable": {"num_steps": 0}}, InvalidArgumentError, "num_steps: expected a positive int, got 0"),
        ({"tunable": {"block_v": 100}}, InvalidArgumentError, "block_v: expected a positive multiple of 128, got 100"),
        ({"tunable": {"num_stepz": 2}}, UnknownArgumentError, "has no option 'num_stepz'; its options"),
        ({"tunabel": {"num_steps": 2}}, UnknownImplementationError, "impl_options: simple_gla has no implementation"),
        ({"tunable": 2}, InvalidArgumentError, "impl_options: expected a mapping from implementation name"),
        ([("tunable", {})], InvalidArgumentError, "impl_options: expected a mapping"),
    ],
)
def test_bad_options_are_rejected_naming_the_option(tunable, impl_options, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        gla_core.dispatch("simple_gla", *qkv(), impl_options=impl_options)


def test_bad_options_given_to_use_are_rejected_at_the_call(tunable):
    with (
        gla_core.use(simple_gla=("tunable", {"num_steps": -1})),
        pytest.raises(InvalidArgumentError, match="num_steps"),
    ):
        gla_core.dispatch("simple_gla", *qkv())


# ----------------------------------------------------------------------------- among


@pytest.fixture
def family(install_registry, fake_impl, plugin_of):
    """simple_gla: `gated` (200, needs a gate), `fast` (100), `middle` (50), `slow` (10)."""
    install_registry(
        plugin_of(
            fake_impl("gated", 200, supports=lambda call: None if call.gates else "needs a gate"),
            fake_impl("fast", 100),
            fake_impl("middle", 50),
            fake_impl("slow", 10),
        )
    )


def test_among_picks_the_highest_priority_accepting_member(family, ran):
    assert ran(gla_core.dispatch("simple_gla", *qkv(), among=("slow", "middle"))) == "middle"
    assert ran(gla_core.dispatch("simple_gla", *qkv(), among=("gated", "slow"))) == "slow"
    gate = jnp.zeros((B, T, H))
    assert ran(gla_core.dispatch("simple_gla", *qkv(), g=gate, among=("gated", "slow"))) == "gated"


def test_among_resolves_once_and_explain_names_the_family(family):
    resolution = gla_core.explain("simple_gla", *qkv(), among=("gated", "middle"))
    assert resolution.winner.name == "middle" and resolution.among == ("gated", "middle")
    assert [(c.implementation.name, c.reason) for c in resolution.candidates] == [
        ("gated", "needs a gate"),
        ("middle", None),
    ]
    assert "among" in str(resolution)


def test_among_is_not_overridden_by_use(family, ran):
    with gla_core.use(simple_gla="fast"):
        assert ran(gla_core.dispatch("simple_gla", *qkv(), among=("middle", "slow"))) == "middle"


def test_among_where_every_member_declines_reports_their_reasons(family):
    with pytest.raises(NoImplementationError, match=r"gated .* declined: needs a gate"):
        gla_core.dispatch("simple_gla", *qkv(), among=("gated",))


@pytest.mark.parametrize(
    ("among", "error", "message"),
    [
        (("fast", "quick"), UnknownImplementationError, "among: simple_gla has no implementation 'quick'"),
        ("fast", InvalidArgumentError, "among: expected a non-empty sequence"),
        ((), InvalidArgumentError, "among: expected a non-empty sequence"),
    ],
)
def test_bad_families_are_rejected(family, among, error, message):
    with pytest.raises(error, match=message):
        gla_core.dispatch("simple_gla", *qkv(), among=among)


def test_among_and_impl_together_are_rejected(family):
    with pytest.raises(InvalidArgumentError, match="impl and among"):
        gla_core.dispatch("simple_gla", *qkv(), impl="fast", among=("fast",))
