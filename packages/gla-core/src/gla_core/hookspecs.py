"""Hook specifications of the `gla` plugin system.

A plugin is a module (found through the entry-point group `gla`) with functions marked
`@hookimpl`. Two hooks: `gla_ops` (ops the plugin defines) and `gla_implementations` (ways to
serve ops). A plugin implements either or both.
"""

from __future__ import annotations

import pluggy

PROJECT = "gla"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def gla_implementations():
    """Called once when the registry loads the plugin.

    Returns:
      A list of `gla_core.Implementation` records the plugin provides.
    """


@hookspec
def gla_ops():
    """Called once when the registry loads the plugin, before any implementation is collected.

    Returns:
      A list of `gla_core.ops.OpSpec` records: the ops the plugin defines (their signature and
      validator). An op is defined by exactly one plugin; implementations of an op that no
      installed plugin defines are not registered (`gla list` says so).
    """
