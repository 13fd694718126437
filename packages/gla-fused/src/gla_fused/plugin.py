"""Entry point of gla-fused in the `gla` plugin group: the implementations it registers."""

from gla_core import hookimpl


@hookimpl
def gla_implementations():
    return []
