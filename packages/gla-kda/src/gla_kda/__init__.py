"""gla-kda: Kimi Delta Attention (op `kda`) and its gate (op `kda_gate`) for gla.

FLA-named functions:
  chunk_kda(q, k, v, g, beta, ...)            chunked; Pallas "chunk" on TPU / interpret, else "xla"
  fused_recurrent_kda(q, k, v, g, beta, ...)  token-by-token scan ("recurrent"); with ssm_state_indices the
                                              serving decode path with a state pool ("decode", "decode_xla")
  fused_kda_gate(g, A_log=None, dt_bias=None, lower_bound=None, output_dtype=None)  # float32 (float64 for float64 g)

Building blocks other implementations reuse: `gla_kda.gate.kda_gate` and
`gla_kda.l2norm.l2norm` (both with `custom_vjp`).
"""

from gla_kda.api import chunk_kda, fused_kda_gate, fused_recurrent_kda

__all__ = ["chunk_kda", "fused_kda_gate", "fused_recurrent_kda"]
