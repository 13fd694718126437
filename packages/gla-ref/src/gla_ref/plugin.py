"""Entry point of gla-ref in the `gla` plugin group: the `reference` implementation of every op.

The reference implementations run the token-by-token recurrences of `gla_ref.recurrent`
(priority 0: chosen only when asked for, or when nothing else accepts), and serve every option of
the ops natively (`state_v_first`, the decode path with a state pool of `gla_ref.decode`, kda's
intermediate states of `gla_ref.chunk_states`). They are plain JAX, so `jax.grad` differentiates
them directly. `o` is returned in v's dtype and the final
state in float32 (float64 when the computation is float64); kda_gate returns `output_dtype`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from gla_core import Implementation, hookimpl
from gla_ref import chunk_states, decode, recurrent

BACKENDS = frozenset({"cpu", "gpu", "tpu"})
PACKAGE = "gla-ref"


# Fields of the arguments record that the recurrences do not take: implementation settings, the
# host copy of cu_seqlens (already checked), FLA's memory/speed switch (nothing is recomputed here),
# and the fields handled by `_attention` itself.
_NOT_RECURRENCE_ARGUMENTS = (
    "chunk_size",
    "interpret",
    "options",
    "output_dtype",
    "cu_seqlens_cpu",
    "disable_recompute",
    "return_intermediate_states",
    "ssm_state_indices",
    "num_accepted_tokens",
    "inplace_final_state",
)


def _recurrence_arguments(args) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name not in _NOT_RECURRENCE_ARGUMENTS}


def _state_dtype(state):
    """float32, or float64 when the state was computed in float64."""
    return state.astype(jnp.promote_types(state.dtype, jnp.float32))


def _attention(op, recurrence):
    """Dispatch adapter of an attention recurrence: `o` in v's dtype, the state in float32 (float64
    if computed in float64); chunk_size and interpret are ignored. Serves every option natively:
    the state pool (`gla_ref.decode`), `state_v_first`, and kda's intermediate states (the state
    entering every chunk, in q's dtype as FLA returns it)."""

    def run(args):
        arguments = _recurrence_arguments(args)
        if args.ssm_state_indices is not None:
            del arguments["output_final_state"]
            o, states = decode.decode(
                op,
                ssm_state_indices=args.ssm_state_indices,
                num_accepted_tokens=args.num_accepted_tokens,
                inplace_final_state=args.inplace_final_state,
                **arguments,
            )
            return o.astype(args.v.dtype), states
        if not getattr(args, "return_intermediate_states", False):
            o, final_state = recurrence(**arguments)
            return o.astype(args.v.dtype), None if final_state is None else _state_dtype(final_state)
        o, final_state, states = recurrence(**arguments, token_states=True)
        initial = args.initial_state
        if initial is None:
            num_states = states.shape[0] if args.cu_seqlens is None else args.cu_seqlens.shape[0] - 1
            initial = jnp.zeros((num_states, *states.shape[2:]), states.dtype)
        h = chunk_states.states_before_chunks(states, initial, args.chunk_size, args.cu_seqlens_cpu)
        final_state = None if final_state is None else _state_dtype(final_state)
        return o.astype(args.v.dtype), final_state, h.astype(args.q.dtype)

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
    "simple_gla": _attention("simple_gla", recurrent.simple_gla),
    "gla": _attention("gla", recurrent.gla),
    "kda": _attention("kda", recurrent.kda),
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
