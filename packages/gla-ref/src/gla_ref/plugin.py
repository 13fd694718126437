"""Entry point of gla-ref in the `gla` plugin group: the `reference` implementation of every op.

The reference implementations run the token-by-token recurrences of `gla_ref.recurrent`
(priority 0: chosen only when asked for, or when nothing else accepts). They are plain
JAX, so `jax.grad` differentiates them directly. `o` is returned in v's dtype and the final
state in float32 (float64 when the computation is float64); kda_gate returns `output_dtype`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from gla_core import Implementation, hookimpl
from gla_ref import recurrent

BACKENDS = frozenset({"cpu", "gpu", "tpu"})
PACKAGE = "gla-ref"


# Fields of the arguments record that the recurrences do not take.
_NOT_RECURRENCE_ARGUMENTS = ("chunk_size", "interpret", "options", "output_dtype")


def _recurrence_arguments(args) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name not in _NOT_RECURRENCE_ARGUMENTS}


def _attention(recurrence):
    """Dispatch adapter of an attention recurrence: `o` in v's dtype, the state in float32 (float64
    if computed in float64); chunk_size and interpret are ignored."""

    def run(args):
        o, final_state = recurrence(**_recurrence_arguments(args))
        if final_state is not None:
            final_state = final_state.astype(jnp.promote_types(final_state.dtype, jnp.float32))
        return o.astype(args.v.dtype), final_state

    return run


def reference_kda_gate(args):
    """Dispatch adapter of `recurrent.kda_gate`, cast to `output_dtype`."""
    return recurrent.kda_gate(**_recurrence_arguments(args)).astype(args.output_dtype)


_DESCRIPTIONS = {
    "simple_gla": "token-by-token lax.scan recurrence (oracle; slow, any shape, varlen, h0/ht)",
    "gla": "token-by-token lax.scan recurrence with per-key decay (oracle; slow, any shape, varlen, h0/ht)",
    "kda": "token-by-token lax.scan delta-rule recurrence (oracle; slow, any shape, grouped heads, varlen)",
    "kda_gate": "plain jnp softplus/sigmoid gate (oracle)",
}

_FUNCTIONS = {
    "simple_gla": _attention(recurrent.simple_gla),
    "gla": _attention(recurrent.gla),
    "kda": _attention(recurrent.kda),
    "kda_gate": reference_kda_gate,
}


@hookimpl
def gla_implementations():
    """The `reference` implementation of every op (records of ops that are not installed, e.g. kda
    without gla-kda, are set aside by the registry)."""
    return [
        Implementation(
            op=op,
            name="reference",
            fn=fn,
            priority=0,
            backends=BACKENDS,
            package=PACKAGE,
            description=_DESCRIPTIONS[op],
        )
        for op, fn in _FUNCTIONS.items()
    ]
