"""kda implementation `chunk`: the Pallas TPU chunk pipeline (FLA's chunk_kda).

In XLA, before the kernels: L2 normalization of q and k (`gla_kda.l2norm`), the gate
(`gla_kda.gate.kda_gate`), the beta sigmoid and the varlen re-layout (q, k, v, g and o are
otherwise read and written as token-major reshapes, `gla_kda.pallas.layout.to_tokens`). The
kernels floor g (`gla_kda.inputs.floor_log_decay`), read non-finite inputs as 0 and write NaN
where the token-by-token recurrence is not finite (`gla_kda.pallas.poison`).
Each of these carries its own gradient; the kernels and their backward live in
`gla_kda.pallas` (`chunk_pipeline`, a `jax.custom_vjp`).

Per-call options (`impl_options={"chunk": {...}}`, per-chip defaults in `gla_core.tuning`):
`kernel_chunk`, the kernels' chunk in place of the call's `chunk_size` (every chunk size computes
the same function up to rounding); `anchor_range`, the largest decay exponent of the anchored
gated products (`gla_kda.pallas.config.KernelConfig.anchor`; 0: the exact products everywhere);
and the per-grid-step counts of `gla_kda.pallas.config.BlockSizes`.
"""

from __future__ import annotations

import jax.numpy as jnp

from gla_core import Call
from gla_core.kit import (
    ANCHOR_RANGE_OPTION,
    KERNEL_CHUNK_OPTION,
    Option,
    kernel_chunk_of,
    positive_int,
    unsupported_dtype_reason,
)
from gla_kda.empty import empty_result, has_no_tokens
from gla_kda.gate import kda_gate
from gla_kda.inputs import beta_of
from gla_kda.l2norm import l2norm
from gla_kda.pallas import layout as kl
from gla_kda.pallas.config import (
    DEFAULT_CHUNKS_PER_STEP,
    DEFAULT_GRAD_CHUNKS_PER_STEP,
    DEFAULT_GRAD_HEADS_PER_STEP,
    DEFAULT_INTRA_CHUNKS_PER_STEP,
    DEFAULT_STATE_GRAD_HEADS_PER_STEP,
    DEFAULT_STATE_HEADS_PER_STEP,
    BlockSizes,
    KernelConfig,
)
from gla_kda.pallas.pipeline import PipelineConfig, chunk_pipeline

PRIORITY = 100


def _count_option(name: str, default: int, doc: str) -> Option:
    return Option(name, default, positive_int(name), doc, candidates=(1, 2, 4, 8))


# One option per count of `BlockSizes` (the sub-block stays `BlockSizes.for_chunk`'s).
BLOCK_COUNT_OPTIONS = (
    _count_option(
        "chunks_per_step",
        DEFAULT_CHUNKS_PER_STEP,
        "most chunks per grid step: state / state_bwd (fixed length)",
    ),
    _count_option("intra_chunks_per_step", DEFAULT_INTRA_CHUNKS_PER_STEP, "most chunks per grid step: intra"),
    _count_option("grad_chunks_per_step", DEFAULT_GRAD_CHUNKS_PER_STEP, "most chunks per grid step: intra_bwd"),
    _count_option("state_heads_per_step", DEFAULT_STATE_HEADS_PER_STEP, "most value heads per grid step: state"),
    _count_option(
        "state_grad_heads_per_step", DEFAULT_STATE_GRAD_HEADS_PER_STEP, "most value heads per grid step: state_bwd"
    ),
    _count_option("grad_heads_per_step", DEFAULT_GRAD_HEADS_PER_STEP, "most value heads per grid step: intra_bwd"),
)
OPTIONS = (KERNEL_CHUNK_OPTION, ANCHOR_RANGE_OPTION, *BLOCK_COUNT_OPTIONS)


def block_sizes_of(options, chunk_size: int) -> BlockSizes:
    """The kernels' tiles for a call's options and `chunk_size`: the `kernel_chunk` option's chunk
    (else `chunk_size`), its default sub-block, and the options' per-step counts."""
    counts = {option.name: options[option.name] for option in BLOCK_COUNT_OPTIONS}
    return BlockSizes.for_chunk(kernel_chunk_of(options, chunk_size), **counts)


def _kernel_dtype(dtype) -> jnp.dtype:
    """Matrix-unit dtype of the kernels: bfloat16 stays bfloat16, anything else runs in float32."""
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(jnp.float32)


def kda_chunk(args):
    """Kimi Delta Attention with the Pallas chunk kernels, on the call's validated arguments record:
    q, k [B, T, H, K]; v [B, T, HV, V] (HV a multiple of H); g [B, T, HV, K] log decay, or the raw
    gate input when `use_gate_in_kernel` (with A_log [HV], dt_bias [HV*K], lower_bound); beta
    [B, T, HV] (logits when `use_beta_sigmoid_in_kernel`); initial_state [N, HV, K, V]; cu_seqlens
    int32 [N+1] (B == 1) or None; options (`OPTIONS`) the kernels' chunk and per-step counts.

    Returns:
      (o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32 or None).
    """
    q, k, v, g = args.q, args.k, args.v, args.g
    initial_state, cu_seqlens = args.initial_state, args.cu_seqlens
    blocks = block_sizes_of(args.options, args.chunk_size)
    output_final_state = args.output_final_state
    batch, seq_len, num_heads, key_dim = q.shape
    num_value_heads, value_dim = v.shape[2], v.shape[3]
    if has_no_tokens(v):
        return empty_result(v, key_dim, initial_state, output_final_state, cu_seqlens, jnp.float32)
    kernel_dtype, out_dtype = _kernel_dtype(q.dtype), v.dtype
    if args.use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if args.use_gate_in_kernel:
        g = kda_gate(g, args.A_log, args.dt_bias, args.lower_bound, output_dtype=jnp.float32)
    g = g.astype(jnp.float32)
    beta = beta_of(args, jnp.float32)
    layout = kl.make_layout(seq_len, key_dim, value_dim, blocks.chunk_size, cu_seqlens, blocks.chunks_per_step)
    kp, vp = layout.key_pad, layout.value_pad
    config = PipelineConfig(
        kernel=KernelConfig(
            blocks=blocks,
            scale=float(args.scale),
            group=num_value_heads // num_heads,
            input_dtype=kernel_dtype.name,
            interpret=bool(args.interpret),
            anchor_range=args.options["anchor_range"],
        ),
        has_initial_state=initial_state is not None,
        output_final_state=output_final_state,
        states_per_row=1 if cu_seqlens is None else cu_seqlens.shape[0] - 1,
        varlen=cu_seqlens is not None,
        keep_states=bool(args.disable_recompute),
    )
    h0 = None if initial_state is None else kl.pad_state(initial_state, layout)
    o, ht = chunk_pipeline(
        config,
        kl.to_tokens(q.astype(kernel_dtype), layout, kp),
        kl.to_tokens(k.astype(kernel_dtype), layout, kp),
        kl.to_tokens(v.astype(kernel_dtype), layout, vp),
        kl.to_tokens(g, layout, kp),
        kl.beta_to_kernel(beta, layout),
        h0,
        kl.chunk_meta(layout, batch),
    )
    o = kl.from_tokens(o, layout, num_value_heads, value_dim).astype(out_dtype)
    if not output_final_state:
        return o, None
    ht = kl.unpad_state(ht, layout)
    if layout.varlen is not None:
        ht = layout.varlen.pass_through_empty(ht, initial_state)
    return o, ht


INTERMEDIATE_STATES_REASON = (
    "return_intermediate_states=True: the Pallas pipeline does not return its per-chunk states; impl='xla' does"
)


def supports(call: Call) -> str | None:
    """Declines what the kernels cannot run: float64 (no 64-bit floats on TPU), and FLA's
    `return_intermediate_states` (see the reason)."""
    if call.option("return_intermediate_states", False):
        return INTERMEDIATE_STATES_REASON
    return unsupported_dtype_reason(call.dtype)
