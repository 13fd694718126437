"""How gla-simple registers an implementation that serves both of its ops, simple_gla and gla."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import gla_core


def for_both_ops(fn: Callable, descriptions: Mapping[str, str], **fields) -> list[gla_core.Implementation]:
    """One `Implementation` per op in `descriptions` ({op: description}), all running `fn`."""
    return [
        gla_core.Implementation(op=op, fn=fn, description=description, package="gla-simple", **fields)
        for op, description in descriptions.items()
    ]
