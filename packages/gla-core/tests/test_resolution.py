"""Resolution rules on hand-built records: no arrays, no plugins, no environment."""

from __future__ import annotations

import pytest

from gla_core import Call
from gla_core.errors import ImplementationDeclinedError, NoImplementationError, UnknownImplementationError
from gla_core.resolution import INTERPRET_HINT, resolve

CPU_CALL = Call(op="simple_gla", batch=2, seq_len=100, num_heads=4, key_dim=64, value_dim=64, gates={"g"})


def test_highest_priority_accepting_implementation_wins(fake_impl):
    impls = [fake_impl("low", 1), fake_impl("high", 9), fake_impl("mid", 5)]
    resolution = resolve(CPU_CALL, impls)
    assert resolution.winner.name == "high"
    assert [c.implementation.name for c in resolution.candidates] == ["high", "mid", "low"]


def test_declining_implementation_is_skipped_with_its_reason(fake_impl):
    impls = [fake_impl("picky", 9, supports=lambda call: "needs K=128"), fake_impl("plain", 1)]
    resolution = resolve(CPU_CALL, impls)
    assert resolution.winner.name == "plain"
    assert resolution.candidates[0].reason == "needs K=128"


def test_other_ops_are_not_candidates(fake_impl):
    resolution = resolve(CPU_CALL, [fake_impl("kda_only", 9, op="kda"), fake_impl("mine", 1)])
    assert [c.implementation.name for c in resolution.candidates] == ["mine"]


def test_off_backend_pallas_impl_declines_with_interpret_hint(fake_impl):
    pallas = fake_impl("chunk", 100, backends={"tpu"}, interpretable=True)
    resolution = resolve(CPU_CALL, [pallas, fake_impl("xla", 50)])
    assert resolution.winner.name == "xla"
    reason = resolution.candidates[0].reason
    assert "current backend is cpu" in reason and INTERPRET_HINT in reason


def test_interpret_mode_makes_interpretable_impl_eligible_off_backend(fake_impl):
    pallas = fake_impl("chunk", 100, backends={"tpu"}, interpretable=True)
    native_only = fake_impl("tpu_only", 200, backends={"tpu"})
    call = Call(op="simple_gla", interpret=True)
    resolution = resolve(call, [pallas, native_only, fake_impl("xla", 50)])
    assert resolution.winner.name == "chunk"
    assert "current backend is cpu" in resolution.candidates[0].reason


def test_supports_that_raises_becomes_a_reason(fake_impl):
    def broken(call):
        raise RuntimeError("plugin bug")

    resolution = resolve(CPU_CALL, [fake_impl("broken", 9, supports=broken), fake_impl("ok", 1)])
    assert resolution.winner.name == "ok"
    assert "RuntimeError: plugin bug" in resolution.candidates[0].reason


def test_forced_implementation_wins_over_priority(fake_impl):
    resolution = resolve(CPU_CALL, [fake_impl("high", 9), fake_impl("low", 1)], forced=("low", "impl='low'"))
    assert resolution.winner.name == "low"
    assert resolution.forced_by == "impl='low'"


def test_forced_implementation_that_declines_raises_its_reason(fake_impl):
    impls = [fake_impl("picky", 9, supports=lambda call: "varlen is not supported"), fake_impl("ok", 1)]
    with pytest.raises(ImplementationDeclinedError, match="varlen is not supported") as info:
        resolve(CPU_CALL, impls, forced=("picky", "impl='picky'"))
    assert info.value.reason == "varlen is not supported"
    assert "picky" in str(info.value)


def test_forcing_an_unknown_implementation_lists_the_registered_ones(fake_impl):
    with pytest.raises(UnknownImplementationError, match=r"'nope'.*registered: a, b"):
        resolve(CPU_CALL, [fake_impl("a", 2), fake_impl("b", 1)], forced=("nope", "impl='nope'"))


def test_no_accepting_implementation_explains_every_candidate(fake_impl):
    impls = [fake_impl("a", 2, supports=lambda call: "reason A"), fake_impl("b", 1, backends={"gpu"})]
    resolution = resolve(CPU_CALL, impls)
    assert resolution.winner is None
    with pytest.raises(NoImplementationError) as info:
        resolution.chosen()
    assert "reason A" in str(info.value) and "runs on gpu" in str(info.value)


def test_report_marks_the_winner_and_lists_every_candidate(fake_impl):
    impls = [fake_impl("a", 2, supports=lambda call: "reason A"), fake_impl("b", 1)]
    text = str(resolve(CPU_CALL, impls))
    assert "declined: reason A" in text
    assert "* b" in text and "chosen: b" in text
    assert CPU_CALL.describe() in text
