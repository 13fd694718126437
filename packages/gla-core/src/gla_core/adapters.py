"""Adapters a plugin applies when it registers an attention implementation.

Every attention op takes `state_v_first` and the state-pool arguments (`gla_core.state_args`).
An implementation either serves them natively or is registered through these adapters:

- `with_state_layout(fn)`: `fn` computes with `[N, H, K, V]` states; the adapter transposes the
  small `initial_state` to that layout before it and every returned state (the final state, and
  any further state output such as kda's intermediate states) back after it when the call has
  `state_v_first=True`. Exact (a transpose), and differentiable.
- `declining_state_pool(supports)`: the implementation does not serve the decode path with a
  state pool (`ssm_state_indices`); the wrapped `supports` declines those calls with
  `STATE_POOL_REASON`, so the decode implementations (or `reference`) serve them.

Example (a plugin's registration):
  >>> Implementation(op="simple_gla", name="mine", fn=with_state_layout(run),
  ...                supports=declining_state_pool(supports), ...)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp

from gla_core.records import Call, accept_every_call
from gla_core.state_args import STATE_POOL

STATE_POOL_REASON = (
    "a state pool (ssm_state_indices): the serving decode path is served by impl='decode' (Pallas TPU), "
    "'decode_xla' or 'reference'"
)


def swap_state_axes(state):
    """[..., K, V] <-> [..., V, K] (None stays None)."""
    return None if state is None else jnp.swapaxes(state, -1, -2)


def with_state_layout(fn: Callable) -> Callable:
    """`fn(args) -> (o, state, *more_states)` that computes with `[N, H, K, V]` states, made to
    honour `args.state_v_first` (see the module doc)."""

    @functools.wraps(fn)
    def run(args):
        if not getattr(args, "state_v_first", False):
            return fn(args)
        o, *states = fn(args.replace(initial_state=swap_state_axes(args.initial_state), state_v_first=False))
        return (o, *map(swap_state_axes, states))

    return run


def declining_state_pool(supports: Callable[[Call], str | None] | None = None) -> Callable[[Call], str | None]:
    """`supports` (None: accept every call), declining calls with a state pool (`ssm_state_indices`) first."""
    supports = accept_every_call if supports is None else supports

    @functools.wraps(supports)
    def check(call: Call) -> str | None:
        if call.option(STATE_POOL) is not None:
            return STATE_POOL_REASON
        return supports(call)

    return check
