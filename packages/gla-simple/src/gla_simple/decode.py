"""The `decode` and `decode_xla` implementations of simple_gla and gla: the serving decode path.

A few tokens of many sequences whose states live in a pool (`ssm_state_indices`, FLA/vLLM's
semantics: `gla_core.state_args`). The prologue here (q scaled once, the gate g + g_gamma as
`[B, T, H, 1]`, or gla's gk) feeds the shared step `gla_core.kit.decode.decode_attention`: the
Pallas TPU kernel (`decode`; TPU, or TPU interpret mode when asked) or its XLA fallback
(`decode_xla`, every backend, differentiable). Both serve only calls with a state pool.
"""

from __future__ import annotations

import gla_core
from gla_core.kit import decode
from gla_simple.frontend import gate_of
from gla_simple.numerics import compute_dtype
from gla_simple.registration import for_both_ops

registration = decode.registration


def _run(args, pallas: bool):
    """simple_gla or gla with a state pool, on the call's validated arguments record.

    Returns (o [B, T, H, V] in v's dtype, the updated pool [P, H, K, V] (or [P, H, V, K]) — or, with
    inplace_final_state=False, the state after every token [B, T, H, K, V]).
    """
    q = args.q.astype(compute_dtype(args.q.dtype)) * args.scale
    return decode.decode_call(args, q, args.k, args.v, gate_of(args), None, pallas=pallas)


def run_pallas(args):
    """The `decode` implementation (Pallas TPU kernel)."""
    return _run(args, pallas=True)


def run_xla(args):
    """The `decode_xla` implementation (plain XLA)."""
    return _run(args, pallas=False)


def implementations() -> list[gla_core.Implementation]:
    both = lambda description: {"simple_gla": description, "gla": description}
    return [
        *for_both_ops(
            run_pallas,
            both(registration.PALLAS_DESCRIPTION),
            serves_state_pool=True,
            name=registration.PALLAS,
            priority=registration.PALLAS_PRIORITY,
            backends=frozenset({"tpu"}),
            supports=registration.supports_pallas,
            interpretable=True,
        ),
        *for_both_ops(
            run_xla,
            both(registration.XLA_DESCRIPTION),
            serves_state_pool=True,
            name=registration.XLA,
            priority=registration.XLA_PRIORITY,
            backends=frozenset({"cpu", "gpu", "tpu"}),
            supports=registration.supports_xla,
        ),
    ]
