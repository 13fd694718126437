"""Entry point of gla-simple in the `gla` plugin group: the implementations it registers."""

from gla_core import hookimpl


@hookimpl
def gla_implementations():
    return []
