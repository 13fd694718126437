"""The serving decode path: a few tokens of many sequences, their states in a pool (`ssm_state_indices`).

Shared by the decode implementations of simple_gla, gla (gla-simple) and kda (gla-kda):
  decode_attention   the step from prepared inputs: the Pallas TPU kernel or the XLA fallback
  decode_call        the same, with the pool arguments taken from an op's arguments record
  layout             the token grid [N, S_pad] and the pool slots
  kernel             the Pallas kernel (`decode_pallas`)
  xla                the XLA fallback (`decode_xla`)
  serving            the decode program at a production serving shape, with its HBM floor
  registration       names, priorities and `supports` of the `decode` / `decode_xla` implementations
The semantics of the pool arguments are in `gla_core.state_args`.
"""

from gla_core.decode import registration, serving
from gla_core.decode.run import decode_attention, decode_call

__all__ = ["decode_attention", "decode_call", "registration", "serving"]
