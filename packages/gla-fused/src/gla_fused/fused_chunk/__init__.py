"""The `fused_chunk` implementation of simple_gla (Pallas TPU).

The forward is one kernel that carries the states in VMEM and writes the outputs directly, the
backward one kernel that walks time backwards carrying the state gradients; both read and write
the op's own layouts, all heads of a block of tokens per grid step. Modules: `steps` (tokens per
grid step), `forward`, `backward`, `pipeline` (the differentiable op), `impl` (the registered
implementation).
"""

from gla_fused.fused_chunk.impl import implementations
from gla_fused.fused_chunk.pipeline import fused_chunk_attention

__all__ = ["fused_chunk_attention", "implementations"]
