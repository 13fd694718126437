"""The `fused_chunk` implementation of simple_gla (Pallas TPU).

The forward is one kernel that carries the state in VMEM and writes the outputs directly,
`num_steps` chunks per grid iteration; the backward is split into a sequential pass (value
and state gradients) and the parallel dq/dk/gate kernel of `gla_core.chunk`. Modules:
`steps` (chunks per grid iteration), `specs` (BlockSpecs), `forward`, `backward` (pass 1),
`pipeline` (the differentiable op), `impl` (the registered implementation).
"""

from gla_fused.fused_chunk.impl import implementations
from gla_fused.fused_chunk.pipeline import fused_chunk_attention

__all__ = ["fused_chunk_attention", "implementations"]
