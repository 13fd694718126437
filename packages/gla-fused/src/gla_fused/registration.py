"""How gla-fused registers its implementations: simple_gla on TPU (and TPU interpret mode)."""

from __future__ import annotations

import gla_core
from gla_core.kit import declining_state_pool, with_state_layout


def fused_implementation(name: str, fn, priority: int, description: str, **fields) -> gla_core.Implementation:
    """A simple_gla Pallas TPU implementation of gla-fused.

    Its kernels compute with `[N, H, K, V]` states: `state_v_first` is served by transposing the small
    states around it (`gla_core.kit.with_state_layout`), and calls with a state pool are declined
    (`declining_state_pool`; the decode implementations serve them).
    """
    fields["supports"] = declining_state_pool(fields.get("supports"))
    return gla_core.Implementation(
        op="simple_gla",
        name=name,
        fn=with_state_layout(fn),
        priority=priority,
        backends=frozenset({"tpu"}),
        package="gla-fused",
        interpretable=True,
        description=description,
        **fields,
    )
