"""gla-fused: fused Pallas TPU implementations of simple_gla.

Implementations registered with gla-core (`gla list`): `fused_g_gamma` (priority 120; calls
whose only gate is `g_gamma`: one kernel call forward, one backward) and `fused_chunk`
(priority 110; every simple_gla gate: several chunks per grid step, two-pass backward).
FLA-named function: `fused_chunk_simple_gla(q, k, v, g=None, g_gamma=None, ...)`.
"""

from gla_fused.functions import fused_chunk_simple_gla

__all__ = ["fused_chunk_simple_gla"]
