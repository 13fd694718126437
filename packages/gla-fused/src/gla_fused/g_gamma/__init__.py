"""simple_gla with a constant per-head decay (`g_gamma` only) on fused Pallas TPU kernels.

Modules: `decay` (the analytic in-chunk decays), `specs` (block shapes and index maps),
`forward` and `backward` (one kernel each, with its launcher), `pipeline` (the custom-VJP
op), `impl` (the registered implementation).
"""

from gla_fused.g_gamma.impl import implementations, supports
from gla_fused.g_gamma.pipeline import fused_g_gamma_attention

__all__ = ["fused_g_gamma_attention", "implementations", "supports"]
