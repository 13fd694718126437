"""Entry point of gla-fused in the `gla` plugin group: the implementations it registers.

Each implementation package exposes `implementations() -> list[gla_core.Implementation]`.
"""

from gla_core import hookimpl
from gla_fused import fused_chunk, g_gamma

_MODULES = (fused_chunk, g_gamma)


@hookimpl
def gla_implementations():
    return [implementation for module in _MODULES for implementation in module.implementations()]
