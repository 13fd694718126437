"""gla-simple: ops simple_gla and gla (scalar and per-key decay gated linear attention).

Implementations registered with gla-core (`gla list`): `chunk` (Pallas TPU kernels of
`gla_core.chunk`), `xla` (chunked plain XLA, the CPU/GPU default), `recurrent` (`lax.scan`
over time), `decode` / `decode_xla` (a state pool). FLA-named functions:

  chunk_simple_gla(q, k, v, g=None, g_gamma=None, ...)     chunked family
  chunk_gla(q, k, v, g, ...)                                chunked family, per-key decay
  fused_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, ...)   recurrence; with ssm_state_indices
  fused_recurrent_gla(q, k, v, gk=None, ...)                        the decode path with a state pool
  parallel_simple_gla(q, k, v, g=None, ..., output_attentions=False)   o and the attention matrix
`decode` and `decode_xla` serve the decode path with a state pool (`ssm_state_indices`).
"""

from gla_simple.functions import (
    chunk_gla,
    chunk_simple_gla,
    fused_recurrent_gla,
    fused_recurrent_simple_gla,
    parallel_simple_gla,
)

__all__ = ["chunk_gla", "chunk_simple_gla", "fused_recurrent_gla", "fused_recurrent_simple_gla", "parallel_simple_gla"]
