"""Per-chip defaults of implementation options (`gla_core.tuning`) and the `gla tune` sweep
(`gla_core.tune`), with fake implementations and a fake cycle count (no TPU compile here)."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import pytest

import gla_core
from gla_core import tune, tuning
from gla_core.errors import InvalidArgumentError
from gla_core.kit import Option, multiple_of, positive_int
from gla_core.registry import default_registry

B, T, H, K, V = 1, 8, 2, 8, 4
OPTIONS = (
    Option("num_steps", 4, positive_int("num_steps"), "chunks per grid step", candidates=(1, 2, 4, 8)),
    Option("block_v", 256, multiple_of("block_v", 128), "largest V tile", candidates=(128, 256)),
)


def qkv():
    return jnp.ones((B, T, H, K)), jnp.ones((B, T, H, K)), jnp.ones((B, T, H, V))


@pytest.fixture
def tunable(install_registry, fake_impl, plugin_of):
    """simple_gla `tunable` (two options with candidates; fn returns num_steps * 1000 + block_v)
    and `plain` (no options)."""
    record = fake_impl("tunable", 100, options=OPTIONS)
    record = gla_core.Implementation(
        **{**record.__dict__, "fn": lambda args: jnp.int32(args.options["num_steps"] * 1000 + args.options["block_v"])}
    )
    install_registry(plugin_of(record, fake_impl("plain", 50)))


@pytest.fixture
def table(monkeypatch):
    """A tuning table with v6e and v5e rows for `tunable` (none for v7x)."""
    rows = {"v6e": {"simple_gla": {"tunable": {"num_steps": 8}}}, "v5e": {"simple_gla": {"tunable": {"num_steps": 2}}}}
    monkeypatch.setattr(tuning, "load_table", lambda: rows)
    return rows


def test_the_target_chips_rows_are_the_defaults(tunable, table):
    assert int(gla_core.dispatch("simple_gla", *qkv())) == 4 * 1000 + 256  # CPU: no chip, declared defaults
    with gla_core.use(chip="v6e"):
        assert int(gla_core.dispatch("simple_gla", *qkv())) == 8 * 1000 + 256
        assert "num_steps=8 (v6e table)" in str(gla_core.explain("simple_gla", *qkv()))
    with gla_core.use(chip="v5e"):
        assert int(gla_core.dispatch("simple_gla", *qkv())) == 2 * 1000 + 256


@pytest.mark.parametrize("chip", ["v7x", "v5e"])
def test_a_chip_without_rows_borrows_v6e(tunable, table, chip):
    table.pop("v5e")
    with gla_core.use(chip=chip):
        assert int(gla_core.dispatch("simple_gla", *qkv())) == 8 * 1000 + 256
        assert "num_steps=8 (v6e table)" in str(gla_core.explain("simple_gla", *qkv()))


def test_the_call_and_use_options_win_over_the_table(tunable, table):
    with gla_core.use(chip="v6e"):
        assert int(gla_core.dispatch("simple_gla", *qkv(), impl_options={"tunable": {"num_steps": 2}})) == 2256
    with gla_core.use(chip="v6e", simple_gla=("tunable", {"num_steps": 1})):
        assert int(gla_core.dispatch("simple_gla", *qkv())) == 1256


def test_a_bad_table_value_is_an_error_naming_the_option(tunable, monkeypatch):
    monkeypatch.setattr(tuning, "load_table", lambda: {"v6e": {"simple_gla": {"tunable": {"block_v": 100}}}})
    with gla_core.use(chip="v6e"), pytest.raises(InvalidArgumentError, match="block_v"):
        gla_core.dispatch("simple_gla", *qkv())


def test_use_rejects_an_unknown_chip():
    expected = r"use\(chip=\.\.\.\): expected one of \['v5e', 'v6e', 'v7x'\], got 'v4'"
    with pytest.raises(InvalidArgumentError, match=expected), gla_core.use(chip="v4"):
        pass


@pytest.mark.parametrize(
    ("device_kind", "chip"),
    [("TPU v5 lite", "v5e"), ("TPU v6 lite", "v6e"), ("TPU7x", "v7x"), ("TPU v4", None), ("cpu", None)],
)
def test_chip_of_device_kind(device_kind, chip):
    assert tuning.chip_of(device_kind) == chip


def _fake_cycles(spec: dict) -> int:
    """Cycles of a fake program: fewest at num_steps=2, block_v=128; num_steps=8 does not compile."""
    options = spec["impl_options"][spec["impl"]]
    if options["num_steps"] == 8:
        raise RuntimeError("VMEM exhausted")
    return 1000 + 10 * abs(options["num_steps"] - 2) + options["block_v"]


def test_sweep_chooses_the_fewest_cycles_per_option(tunable):
    rows, trials = tune.sweep("simple_gla", "v6e", measure=_fake_cycles)
    assert rows == {"tunable": {"num_steps": 2, "block_v": 128}}
    failed = [trial for trial in trials if trial.cycles is None]
    assert [dict(trial.options)["num_steps"] for trial in failed] == [8] and "VMEM exhausted" in failed[0].error
    assert len({(trial.options, trial.stage) for trial in trials}) == len(trials)  # every program compiled once
    assert [(dict(trial.options), trial.stage) for trial in trials][-1] == ({"num_steps": 2, "block_v": 128}, "fwd")
    report = tune.render("simple_gla", "v6e", rows, trials)
    assert "| tunable | block_v=128, num_steps=2 | 1,128 | chosen |" in report


def test_sweep_keeps_an_option_without_effect_at_its_default(tunable):
    """num_steps changes nothing at the default block_v=256: the sweep keeps num_steps=4 rather than
    the first candidate 1, so block_v=128 is then tried where it gives the fewest cycles."""

    def cycles(spec: dict) -> int:
        options = spec["impl_options"][spec["impl"]]
        return 1000 if options["block_v"] == 256 else 900 - 10 * options["num_steps"]

    rows, _ = tune.sweep("simple_gla", "v6e", measure=cycles)
    assert rows == {"tunable": {"num_steps": 4, "block_v": 128}}  # 860 cycles; 890 with num_steps=1
    rows, _ = tune.sweep("simple_gla", "v6e", measure=lambda spec: 1)
    assert rows == {"tunable": {"num_steps": 4, "block_v": 256}}


def test_sweep_tries_a_default_outside_the_candidates(tunable, monkeypatch):
    """num_steps=16 is the declared default but no candidate: it is compiled too, and kept when it
    gives the fewest cycles."""
    record = default_registry().implementations("simple_gla")[0]
    options = tuple(
        dataclasses.replace(option, default=16) if option.name == "num_steps" else option for option in record.options
    )
    monkeypatch.setattr(tune, "tunable", lambda op: [dataclasses.replace(record, options=options)])

    def cycles(spec: dict) -> int:
        return 100 - spec["impl_options"]["tunable"]["num_steps"]

    rows, trials = tune.sweep("simple_gla", "v6e", measure=cycles)
    assert rows == {"tunable": {"num_steps": 16, "block_v": 256}}
    assert [dict(trial.options)["num_steps"] for trial in trials][:5] == [16, 1, 2, 4, 8]


@pytest.mark.parametrize(("chip", "kept"), [("v6e", 8), ("v7x", 8), ("v5e", 2)])
def test_sweep_starts_from_the_chips_table_row(tunable, table, chip, kept):
    """num_steps 2 and 8 tie: the sweep keeps the value the chip's row (own or borrowed) gives it, and
    compiles that row first."""

    def cycles(spec: dict) -> int:
        return 100 if spec["impl_options"]["tunable"]["num_steps"] in (2, 8) else 200

    rows, trials = tune.sweep("simple_gla", chip, measure=cycles)
    assert rows == {"tunable": {"num_steps": kept, "block_v": 256}}
    assert dict(trials[0].options) == {"num_steps": kept, "block_v": 256}


def test_sweep_writes_no_row_whose_choice_does_not_compile_the_other_stage(tunable):
    """The training step is fastest at num_steps=8, whose forward does not compile: no row."""

    def cycles(spec: dict) -> int:
        num_steps = spec["impl_options"]["tunable"]["num_steps"]
        if spec["stage"] == "fwd" and num_steps == 8:
            raise RuntimeError("scoped VMEM exhausted")
        return 100 - num_steps

    rows, trials = tune.sweep("simple_gla", "v6e", stage="train", measure=cycles)
    assert rows == {}
    (check,) = [trial for trial in trials if trial.stage is not None]
    assert check.stage == "fwd" and check.cycles is None and "scoped VMEM" in check.error
    assert "| fwd check |" in tune.render("simple_gla", "v6e", rows, trials)


def test_sweep_specs_name_the_chip_the_implementation_and_its_options(tunable):
    seen = []
    tune.sweep("simple_gla", "v5e", seq_len=512, measure=lambda spec: seen.append(spec) or 1)
    assert {spec["chip"] for spec in seen} == {"v5e"} and {spec["impl"] for spec in seen} == {"tunable"}
    assert all(spec["seq_len"] == 512 and set(spec["impl_options"]) == {"tunable"} for spec in seen)


def test_write_rows_replaces_one_op_of_one_chip(tmp_path):
    path = tmp_path / "tuned.json"
    tuning.write_rows("v6e", "gla", {"chunk": {"block_chunks": 8}}, path)
    tuning.write_rows("v5e", "gla", {"chunk": {"block_chunks": 4}}, path)
    tuning.write_rows("v6e", "gla", {"chunk": {"block_chunks": 2}}, path)
    assert json.loads(path.read_text()) == {
        "v5e": {"gla": {"chunk": {"block_chunks": 4}}},
        "v6e": {"gla": {"chunk": {"block_chunks": 2}}},
    }


def test_the_shipped_table_names_installed_implementations_and_valid_values():
    table = tuning.load_table()
    assert set(table) <= set(tuning.CHIPS)
    for chip, ops in table.items():
        for op, implementations in ops.items():
            records = {record.name: record for record in default_registry().implementations(op)}
            for name, values in implementations.items():
                assert name in records, f"{chip}/{op}: {name} is not installed"
                declared = {option.name: option for option in records[name].options}
                for option_name, value in values.items():
                    assert declared[option_name].check(value) == value, f"{chip}/{op}/{name}/{option_name}"
