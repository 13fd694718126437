"""kda implementations `decode` and `decode_xla`: the serving decode path (vLLM's use of
`fused_recurrent_kda`), a few tokens of many sequences whose states live in a pool.

The pool semantics are FLA/vLLM's (`ssm_state_indices`, `num_accepted_tokens`,
`inplace_final_state`; `gla_core.state_args`). The prologue is every kda implementation's
(`gla_kda.inputs.prepare_inputs`: l2norm, the in-kernel gate, beta's sigmoid, the scale); the step
is the shared `gla_core.kit.decode.decode_attention` with the delta rule: the Pallas TPU kernel
(`decode`) or its XLA fallback (`decode_xla`, every backend, differentiable).
"""

from __future__ import annotations

from gla_core.kit import decode
from gla_kda.inputs import prepare_inputs

registration = decode.registration


def _run(args, pallas: bool):
    """kda with a state pool, on the call's validated arguments record.

    Returns (o [B, T, HV, V] in v's dtype, the updated pool [P, HV, K, V] (or [P, HV, V, K]) — or, with
    inplace_final_state=False, the state after every token [B, T, HV, K, V]).
    """
    prepared = prepare_inputs(args)
    return decode.decode_call(args, prepared.q, prepared.k, prepared.v, prepared.g, prepared.beta, pallas=pallas)


def run_pallas(args):
    """The `decode` implementation (Pallas TPU kernel)."""
    return _run(args, pallas=True)


def run_xla(args):
    """The `decode_xla` implementation (plain XLA)."""
    return _run(args, pallas=False)
