"""gla-fused: fused Pallas TPU implementations of simple_gla.

Implementations registered with gla-core (`gla list`): `fused_chunk` (priority 110; every
simple_gla gate: one kernel forward, one backward, all heads of a block of tokens per grid step
on the op's own layout) and `fused_g_gamma` (priority 105; calls whose only gate is `g_gamma`:
one kernel call forward, one backward, decays computed in the kernel).
FLA-named function: `fused_chunk_simple_gla(q, k, v, g=None, g_gamma=None, ...)`.
"""

from gla_fused.functions import fused_chunk_simple_gla

__all__ = ["fused_chunk_simple_gla"]
