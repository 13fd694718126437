"""The `xla` implementations of simple_gla and gla: chunked, plain `jnp`, every backend.

The CPU/GPU default and the baseline every Pallas kernel is compared with. The math is in
`gla_simple.chunked` (one core for both ops: a scalar decay is a [.., 1] gate broadcast over
the keys, a per-key decay a [.., K] gate); the chunk size is the call's `chunk_size`.
"""

from __future__ import annotations

import gla_core
from gla_simple import frontend
from gla_simple.chunked import chunked_core
from gla_simple.registration import for_both_ops

PRIORITY = 50
BACKENDS = frozenset({"cpu", "gpu", "tpu"})


def run(args):
    """simple_gla or gla on the chunked XLA core, on the call's validated arguments record."""
    return frontend.run(chunked_core, args)


def implementations() -> list[gla_core.Implementation]:
    descriptions = {
        "simple_gla": "chunked plain-XLA GEMMs (f32), hand-written backward; the CPU/GPU default",
        "gla": "chunked plain-XLA GEMMs with sub-chunked per-key decay (f32), hand-written backward",
    }
    return for_both_ops(run, descriptions, name="xla", priority=PRIORITY, backends=BACKENDS)
