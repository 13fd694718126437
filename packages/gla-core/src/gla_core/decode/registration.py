"""What the decode implementations of every op share: names, priorities, `supports`, descriptions.

Each op's plugin registers two implementations around `decode_attention` with its own prologue:
`decode` (the Pallas TPU kernel; TPU, or TPU interpret mode when asked) and `decode_xla` (every
backend). Both serve only calls with a state pool (`ssm_state_indices`); every other implementation
declines those (`gla_core.adapters.declining_state_pool`).
"""

from __future__ import annotations

from gla_core.records import Call
from gla_core.state_args import STATE_POOL
from gla_core.tpu import unsupported_dtype_reason

PALLAS = "decode"
XLA = "decode_xla"
PALLAS_PRIORITY = 90
XLA_PRIORITY = 40
FAMILY = (PALLAS, XLA)  # what FLA's fused_recurrent_* run with ssm_state_indices
PALLAS_DESCRIPTION = (
    "Pallas TPU decode kernel: a few tokens per sequence, states read from and written to a pool (ssm_state_indices)"
)
XLA_DESCRIPTION = "decode step with a state pool (ssm_state_indices) in plain XLA: gather, scan over tokens, scatter"
POOL_ONLY_REASON = (
    "serves the serving decode path only: calls with a state pool (ssm_state_indices); this call has none"
)


def supports_pallas(call: Call) -> str | None:
    """Calls with a state pool, in bfloat16/float16/float32 (the kernel computes in float32)."""
    if call.option(STATE_POOL) is None:
        return POOL_ONLY_REASON
    return unsupported_dtype_reason(call.dtype)


def supports_xla(call: Call) -> str | None:
    """Calls with a state pool."""
    if call.option(STATE_POOL) is None:
        return POOL_ONLY_REASON
    return None
