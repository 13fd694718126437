"""Entry point of gla-simple in the `gla` plugin group: the implementations it registers.

Each implementation module exposes `implementations() -> list[gla_core.Implementation]`;
registering a new one is one more entry in `_MODULES`.
"""

from gla_core import hookimpl
from gla_simple import chunk, decode, recurrent, xla

_MODULES = (xla, recurrent, chunk, decode)


@hookimpl
def gla_implementations():
    return [implementation for module in _MODULES for implementation in module.implementations()]
