"""How gla-simple registers an implementation that serves both of its ops, simple_gla and gla."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import gla_core
from gla_core.kit import declining_state_pool, with_state_layout


def for_both_ops(
    fn: Callable, descriptions: Mapping[str, str], *, serves_state_pool: bool = False, **fields
) -> list[gla_core.Implementation]:
    """One `Implementation` per op in `descriptions` ({op: description}), all running `fn`.

    Unless `serves_state_pool` (the decode implementations, which read the pool and both state
    layouts natively), `fn` computes with `[N, H, K, V]` states and declines state pools: it is
    registered through `gla_core.kit.with_state_layout` and `declining_state_pool`.
    """
    if not serves_state_pool:
        fn = with_state_layout(fn)
        fields["supports"] = declining_state_pool(fields.get("supports"))
    return [
        gla_core.Implementation(op=op, fn=fn, description=description, package="gla-simple", **fields)
        for op, description in descriptions.items()
    ]
