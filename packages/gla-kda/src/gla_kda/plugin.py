"""Entry point of gla-kda in the `gla` plugin group: the ops it defines (`gla_kda.ops`) and the
implementations it registers (their functions live in `chunk`, `xla`, `recurrent` and `gate`)."""

from gla_core import Implementation, hookimpl
from gla_kda import chunk, gate, ops, recurrent, xla

EVERY_BACKEND = frozenset({"cpu", "gpu", "tpu"})


def _implementation(op: str, name: str, fn, priority: int, description: str, **fields) -> Implementation:
    fields.setdefault("backends", EVERY_BACKEND)
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
        ),
        _implementation(
            "kda_gate",
            "xla",
            gate.kda_gate_xla,
            50,
            "fused elementwise jnp with a hand-written custom_vjp (g, A_log, dt_bias)",
        ),
    ]
