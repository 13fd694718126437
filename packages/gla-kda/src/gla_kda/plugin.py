"""Entry point of gla-kda in the `gla` plugin group: the ops it defines (`gla_kda.ops`) and the
implementations it registers (their functions live in `chunk`, `xla`, `recurrent`, `decode` and `gate`)."""

from gla_core import Implementation, hookimpl
from gla_core.kit import declining_state_pool, with_state_layout
from gla_kda import chunk, decode, gate, ops, recurrent, xla

EVERY_BACKEND = frozenset({"cpu", "gpu", "tpu"})


def _implementation(
    op: str, name: str, fn, priority: int, description: str, *, serves_state_pool: bool = False, **fields
) -> Implementation:
    """One gla-kda implementation. A kda implementation computes with [N, HV, K, V] states and declines
    state pools (`gla_core.kit.with_state_layout`, `declining_state_pool`) unless `serves_state_pool`
    (the decode implementations read the pool and both state layouts natively)."""
    fields.setdefault("backends", EVERY_BACKEND)
    if op == "kda" and not serves_state_pool:
        fn = with_state_layout(fn)
        fields["supports"] = declining_state_pool(fields.get("supports"))
    return Implementation(
        op=op, name=name, fn=fn, priority=priority, package="gla-kda", description=description, **fields
    )


@hookimpl
def gla_ops():
    return [ops.KDA, ops.KDA_GATE]


@hookimpl
def gla_implementations():
    return [
        _implementation(
            "kda",
            "chunk",
            chunk.kda_chunk,
            chunk.PRIORITY,
            "Pallas TPU chunk pipeline: intra (I+Akk)^-1/Aqk, state, output; custom_vjp backward",
            backends=frozenset({"tpu"}),
            supports=chunk.supports,
            interpretable=True,
            options=chunk.OPTIONS,
        ),
        _implementation(
            "kda",
            "xla",
            xla.kda_xla,
            50,
            "chunked jnp (WY form, blocked triangular inverse, scan over chunks); JAX autodiff backward",
        ),
        _implementation(
            "kda",
            "recurrent",
            recurrent.kda_recurrent,
            10,
            "lax.scan over time (decode path); autodiff backward with checkpointed segments",
            supports=recurrent.supports,
        ),
        _implementation(
            "kda",
            decode.registration.PALLAS,
            decode.run_pallas,
            decode.registration.PALLAS_PRIORITY,
            decode.registration.PALLAS_DESCRIPTION,
            serves_state_pool=True,
            backends=frozenset({"tpu"}),
            supports=decode.registration.supports_pallas,
            interpretable=True,
        ),
        _implementation(
            "kda",
            decode.registration.XLA,
            decode.run_xla,
            decode.registration.XLA_PRIORITY,
            decode.registration.XLA_DESCRIPTION,
            serves_state_pool=True,
            supports=decode.registration.supports_xla,
        ),
        _implementation(
            "kda_gate",
            "xla",
            gate.kda_gate_xla,
            50,
            "fused elementwise jnp with a hand-written custom_vjp (g, A_log, dt_bias)",
        ),
    ]
