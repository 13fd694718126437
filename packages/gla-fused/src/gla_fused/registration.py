"""How gla-fused registers its implementations: simple_gla on TPU (and TPU interpret mode)."""

from __future__ import annotations

import gla_core


def fused_implementation(name: str, fn, priority: int, description: str, **fields) -> gla_core.Implementation:
    """A simple_gla Pallas TPU implementation of gla-fused."""
    return gla_core.Implementation(
        op="simple_gla",
        name=name,
        fn=fn,
        priority=priority,
        backends=frozenset({"tpu"}),
        package="gla-fused",
        interpretable=True,
        description=description,
        **fields,
    )
