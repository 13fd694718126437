"""Entry point of gla-kda in the `gla` plugin group: the implementations it registers.

Each implementation module exposes `implementations() -> list[Implementation]`; this hook
only concatenates them.
"""

from gla_core import hookimpl
from gla_kda import chunk, gate, recurrent, xla


@hookimpl
def gla_implementations():
    return [*xla.implementations(), *recurrent.implementations(), *gate.implementations(), *chunk.implementations()]
