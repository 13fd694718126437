"""The `fused_g_gamma` implementation of simple_gla: calls whose only gate is `g_gamma`.

One Pallas TPU kernel for the forward and one for the backward (see `forward`, `backward`),
with the gates computed analytically from g_gamma inside them. TPU only; off TPU it runs in
TPU interpret mode when the call asks for it.
"""

from __future__ import annotations

import gla_core
from gla_core import errors
from gla_core.kit import BLOCK_V_OPTION, block_sizes_of, unsupported_dtype_reason
from gla_fused.g_gamma.pipeline import IMPLEMENTATION, fused_g_gamma_attention
from gla_fused.registration import fused_implementation

NAME = IMPLEMENTATION
# Below fused_chunk (110): by libtpu's static estimate (v6e, B2 T4096 H16 K=V=128 bf16, h0/ht)
# fused_chunk's g_gamma forward is 0.37 M cycles against 1.31 M, its training step 1.42 M against
# 5.1 M, with less temp memory (64 MiB against 97 MiB). It stays selectable with impl=.
PRIORITY = 105
BACKENDS = frozenset({"tpu"})
OPTIONS = (BLOCK_V_OPTION,)


def run(args):
    """simple_gla on the fused g_gamma kernels, on the call's validated arguments record.

    Only calls `supports` accepts reach it: g_gamma given, no g, no cu_seqlens.
    """
    if args.g is not None or args.g_gamma is None:
        raise errors.InvalidArgumentError(
            f"g_gamma: {NAME} needs g_gamma [H] as the only gate (got g={args.g is not None})"
        )
    if args.cu_seqlens is not None:
        raise errors.InvalidArgumentError(f"cu_seqlens: {NAME} handles fixed-length batches only; use impl='chunk'")
    return fused_g_gamma_attention(
        args.q,
        args.k,
        args.v,
        args.g_gamma,
        scale=args.scale,
        initial_state=args.initial_state,
        output_final_state=args.output_final_state,
        chunk_size=args.chunk_size,
        interpret=args.interpret,
        block_sizes=block_sizes_of(args.options),
    )


def _describe_gates(gates) -> str:
    return "{" + ", ".join(repr(g) for g in sorted(gates)) + "}" if gates else "no gate"


def supports(call: gla_core.Call) -> str | None:
    """Accepts fixed-length bfloat16/float32 (or float16) calls whose only gate is g_gamma."""
    if call.gates != {"g_gamma"}:
        return f"needs g_gamma as the only gate; this call has {_describe_gates(call.gates)}: use fused_chunk or chunk"
    dtype_reason = unsupported_dtype_reason(call.dtype)
    if dtype_reason is not None:
        return dtype_reason
    if call.varlen:
        return (
            f"packed varlen input (cu_seqlens, {call.num_sequences} sequences): {NAME} handles "
            "fixed-length batches only; use impl='fused_chunk' or impl='chunk'"
        )
    return None


def implementations() -> list[gla_core.Implementation]:
    description = (
        "g_gamma-only simple_gla: one fused Pallas TPU kernel forward, one backward, "
        "analytic in-kernel decays, exact d g_gamma"
    )
    return [fused_implementation(NAME, run, PRIORITY, description, supports=supports, options=OPTIONS)]
