"""Per-chip defaults of the implementations' tuning options, in one table.

`tuned_defaults.json` (next to this module, written by `gla tune`) maps
chip -> op -> implementation -> {option: value}. An option a call does not set takes the value
of the table for the chip the call is traced for (`target_chip`), else the option's own default
(`gla_core.options.Option.default`). Chips without rows of their own borrow those of a close
relative (`BORROWED_FROM`); `explain` says which table a value came from. v7x borrows v6e's
rows until it is swept itself; v5e borrows v6e's rows of every implementation it has none for
(gla and simple_gla): their v5e sweeps at `gla tune`'s shape chose values that lose at the cost
report's shapes. v5e's kda `chunk` row is `gla tune`'s, but for intra_chunks_per_step, which the
sweep could not tell apart at its shape (8 chunks per head) and which takes 16 as on v6e.
v6e's fused_chunk `block_tokens` of 512 is set by hand too: the sweep that wrote its row could not compile 512
(the kernels' scoped VMEM limit did not count their [C, C] temporaries, see
`gla_fused.fused_chunk.forward.sequential_in_time_params`); with the limit counting them, 512
beats 256 on every simple_gla program of the cost report (v6e static estimate over the floor,
B=2 T=4096 H=16: g 1.80 -> 1.59 forward, 2.79 -> 2.71 training; g_gamma 1.81 -> 1.59, 2.83 -> 2.74;
packed 4 sequences in T=8192: 1.87 -> 1.74, 3.07 -> 2.98). v6e's kda `chunk` row is the choice of
`gla tune kda --chip v6e -T 2048 -H 8` (16 chunks per head, so the chunk counts per step up to 16 are
told apart).
"""

from __future__ import annotations

import functools
import json
import pathlib
from collections.abc import Mapping
from typing import Any

import jax

from gla_core.errors import InvalidArgumentError

TABLE_PATH = pathlib.Path(__file__).with_name("tuned_defaults.json")
CHIPS = ("v5e", "v6e", "v7x")
BORROWED_FROM = {"v7x": "v6e", "v5e": "v6e"}
# Substrings of `jax.Device.device_kind`, lowercase, by chip.
_DEVICE_KINDS = {"v5e": ("v5 lite", "v5e"), "v6e": ("v6 lite", "v6e"), "v7x": ("tpu7x", "v7x", "tpu v7")}


def check_chip(chip: Any, argument: str = "chip") -> str:
    """`chip` if it is one of `CHIPS`, else an `InvalidArgumentError` naming `argument`."""
    if chip not in CHIPS:
        raise InvalidArgumentError(f"{argument}: expected one of {list(CHIPS)}, got {chip!r}")
    return chip


def chip_of(device_kind: str) -> str | None:
    """The chip of a TPU `device_kind` ("TPU v6 lite" -> "v6e"), or None for other devices."""
    kind = device_kind.lower()
    return next((chip for chip, names in _DEVICE_KINDS.items() if any(name in kind for name in names)), None)


def target_chip() -> str | None:
    """The chip calls are traced for: `gla_core.use(chip=...)`, else JAX's first device if it is a
    TPU of a known chip, else None (no table applies)."""
    from gla_core.overrides import current  # overrides imports this module

    chosen = current().chip
    if chosen is not None:
        return chosen
    device = jax.devices()[0]
    return chip_of(device.device_kind) if device.platform == "tpu" else None


@functools.cache
def load_table(path: pathlib.Path = TABLE_PATH) -> dict[str, Any]:
    """The table as written by `gla tune` (an empty table if the file is missing)."""
    return json.loads(path.read_text()) if path.exists() else {}


def tuned_defaults(op: str, implementation: str, chip: str | None) -> tuple[Mapping[str, Any], str | None]:
    """(option values of the table for `implementation` of `op` on `chip`, the chip whose rows
    they are), or ({}, None) when the table has none."""
    if chip is None:
        return {}, None
    table = load_table()
    for source in (chip, BORROWED_FROM.get(chip)):
        values = table.get(source, {}).get(op, {}).get(implementation) if source else None
        if values:
            return values, source
    return {}, None


def write_rows(chip: str, op: str, rows: Mapping[str, Mapping[str, Any]], path: pathlib.Path = TABLE_PATH) -> None:
    """Replaces the rows of `op` on `chip` (implementation -> options) in the table file."""
    table = json.loads(path.read_text()) if path.exists() else {}
    table.setdefault(check_chip(chip), {})[op] = {name: dict(values) for name, values in rows.items()}
    path.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    load_table.cache_clear()
