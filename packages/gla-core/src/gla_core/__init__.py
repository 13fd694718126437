"""gla-core: the registry, dispatch and validation shared by every gla package.

Public surface:
  dispatch(op, *arrays, impl=None, among=None, **kwargs)   run an op with the best implementation
  explain(op, *arrays, impl=None, among=None, **kwargs)    every candidate, its verdict, the winner
  dispatch_sharded(op, *arrays, context_axis=..., mesh=...)   context parallelism on global arrays
    (inside your own jax.shard_map: dispatch(..., context_axis=...); see gla_core.context_parallel)
  implementations(op=None), ops()              what is registered
  use(backend=..., interpret=..., **{op: name or (name, options)})   override dispatch in a with-block
  backend()                                    the backend calls run on
  errors                                       exception classes
  kit                                          everything a plugin builds on (records, hooks, kernels)
"""

from gla_core import errors
from gla_core.backend import backend
from gla_core.context_parallel import dispatch_sharded
from gla_core.dispatch import dispatch, explain, implementations, ops
from gla_core.hookspecs import hookimpl
from gla_core.overrides import use
from gla_core.records import Call, Implementation
from gla_core.resolution import Resolution

__all__ = [
    "Call",
    "Implementation",
    "Resolution",
    "backend",
    "dispatch",
    "dispatch_sharded",
    "errors",
    "explain",
    "hookimpl",
    "implementations",
    "ops",
    "use",
]
