"""gla-core: the registry, dispatch and validation shared by every gla package.

Public surface:
  dispatch(op, *arrays, impl=None, **kwargs)   run an op with the best implementation
  explain(op, *arrays, impl=None, **kwargs)    every candidate, accepted or declined, and the winner
  implementations(op=None)                     what is registered
  use(backend=..., interpret=..., **{op: name}) override dispatch in a with-block
  backend()                                    the backend calls run on
  Implementation, Call, hookimpl               for plugins
  errors                                       exception classes
"""

from gla_core import errors
from gla_core.backend import backend
from gla_core.dispatch import dispatch, explain, implementations
from gla_core.hookspecs import hookimpl
from gla_core.overrides import use
from gla_core.records import OPS, Call, Implementation
from gla_core.resolution import Resolution

__all__ = [
    "OPS",
    "Call",
    "Implementation",
    "Resolution",
    "backend",
    "dispatch",
    "errors",
    "explain",
    "hookimpl",
    "implementations",
    "use",
]
