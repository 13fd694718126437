"""Hook specifications of the `gla` plugin system.

A plugin is a module (found through the entry-point group `gla`) with functions marked
`@hookimpl`. There is one hook.
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
