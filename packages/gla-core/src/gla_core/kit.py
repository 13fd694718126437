"""The plugin kit: everything a package that adds ops or implementations to gla builds on.

Sibling packages (gla-simple, gla-fused, gla-kda, gla-ref, and third-party plugins) import gla-core
through three modules only: `gla_core` (dispatch and the records), `gla_core.errors` and this one.
The names here are the stable surface; the modules behind them may move.

Registry and records
  hookimpl, Implementation, Call, OpSpec, op_spec, attention_spec, Option, ImplOptions, positive_int, multiple_of,
  ContextParallelSpec (how an op's state carries across devices under `context_axis`),
  ATTENTION_KEYWORDS, CHUNK_SIZES, DEFAULT_CHUNK_SIZE,
  dispatch_by_name (dispatch from a function with FLA's signature: its `locals()`)
Validation building blocks (for an op's validator)
  require_rank, require_shape, require_float, require_bool, check_gate, check_state,
  check_cu_seqlens, resolve_scale, validate_qkv, validate_common, attention_call, is_concrete,
  validate (runs an op's validation as dispatch does: for tests of a validator)
TPU helpers
  NUM_LANES, NUM_SUBLANES, round_up, pad_axis, interpret_params, unsupported_dtype_reason, any_nonfinite,
  detect_races
JAX transformations through Pallas implementations
  fold_vmap, first_order_only
Packed sequences
  varlen (ChunkLayout, build_chunk_layout, num_padded_chunks, to_chunks, gather_chunks, from_chunks)
The shared Pallas chunk kernels (simple_gla / gla) and their pieces
  chunk_gated_attention, chunk_fwd_h, chunk_bwd_dqkg, ChunkConfig, KernelInputs, kernel_inputs, define_chunk_vjp,
  op_gradients, prepare, BlockSizes, DEFAULT_BLOCK_SIZES, ChunkMasks, ScalarGate, GATE_FLOOR,
  floor_gates, intra_costs, empty_attention, has_no_tokens, and the in-kernel helpers dot, NN, NT,
  TN (and BATCHED_NN, BATCHED_NT, BATCHED_TN over a leading batch axis), mxu_dtype, causal_dot,
  row_to_column, column_to_row, compiler_params, cost_estimate, bfloat16_parts (a float32 array as
  three bfloat16 parts that sum to it exactly);
  the tile options of their implementations: BLOCK_V_OPTION, BLOCK_K_OPTION, BLOCK_CHUNKS_OPTION,
  BLOCK_SIZE_OPTIONS (those and the token-major step sizes), block_sizes_of, ANCHOR_RANGE_OPTION
  (the anchored fast path), KERNEL_CHUNK_OPTION and kernel_chunk_of (the kernels' chunk)
The per-key gated intra-chunk products (also kda's)
  StepDecays, default_anchor_range, all_within (the range checks), AnchoredProducts, BlockedProducts, LevelProducts,
  recompute_products (a step out of the anchor range), mask_table_inputs
Kernels on the op's own token-major layout (no transposed copies)
  merge_heads, split_heads (the free [B, T*H, D] view), HeadRows, heads_per_group (per-head rows of a block),
  chunk_cumsum, two_sum, floor_cumsum_gates, CUMSUM_GATE_FLOOR (compensated in-kernel cumulative log decays)
State arguments (state_v_first, the decode path's state pool; semantics in gla_core.state_args)
  with_state_layout, declining_state_pool, swap_state_axes, STATE_POOL_REASON (adapters for registering an
  implementation), decode (the serving decode step: decode_attention, decode.registration), host_boundaries,
  state_v_first_of (FLA's deprecated transpose_state_layout), STATE_POOL, STATE_V_FIRST
Checks for TPU without a TPU (tests)
  export_for_tpu, compile_for_tpu, CompileReport, DEFAULT_SCOPED_VMEM_BYTES, KERNEL_VMEM_BUDGET_BYTES,
  INTERPRET_HINT
"""

from gla_core import decode, varlen
from gla_core.adapters import STATE_POOL_REASON, declining_state_pool, swap_state_axes, with_state_layout
from gla_core.chunk import BlockSizes, chunk_gated_attention, prepare
from gla_core.chunk.anchored import ANCHOR_RANGE_OPTION, StepDecays, all_within, default_anchor_range
from gla_core.chunk.bwd_dqkg import chunk_bwd_dqkg
from gla_core.chunk.common import (
    BATCHED_NN,
    BATCHED_NT,
    BATCHED_TN,
    BLOCK_CHUNKS_OPTION,
    BLOCK_K_OPTION,
    BLOCK_SIZE_OPTIONS,
    BLOCK_V_OPTION,
    DEFAULT_BLOCK_SIZES,
    KERNEL_CHUNK_OPTION,
    NN,
    NT,
    TN,
    bfloat16_parts,
    block_sizes_of,
    causal_dot,
    column_to_row,
    compiler_params,
    cost_estimate,
    dot,
    kernel_chunk_of,
    mxu_dtype,
    row_to_column,
)
from gla_core.chunk.cumsum import CUMSUM_GATE_FLOOR, chunk_cumsum, floor_cumsum_gates, two_sum
from gla_core.chunk.empty import empty_attention, has_no_tokens
from gla_core.chunk.fwd_h import chunk_fwd_h
from gla_core.chunk.gates import GATE_FLOOR, ChunkMasks, ScalarGate, floor_gates, intra_costs, mask_table_inputs
from gla_core.chunk.pipeline import ChunkConfig, KernelInputs, define_chunk_vjp, kernel_inputs, op_gradients
from gla_core.chunk.products import AnchoredProducts, BlockedProducts, LevelProducts, recompute_products
from gla_core.dispatch import dispatch_by_name
from gla_core.hookspecs import hookimpl
from gla_core.ops import (
    ATTENTION_KEYWORDS,
    CHUNK_SIZES,
    DEFAULT_CHUNK_SIZE,
    ContextParallelSpec,
    OpSpec,
    attention_spec,
)
from gla_core.options import ImplOptions, Option, multiple_of, positive_int
from gla_core.pallas_transforms import first_order_only, fold_vmap
from gla_core.records import Call, Implementation
from gla_core.registry import default_registry
from gla_core.resolution import INTERPRET_HINT
from gla_core.state_args import STATE_POOL, STATE_V_FIRST, host_boundaries, state_v_first_of
from gla_core.token_major import HeadRows, heads_per_group, merge_heads, split_heads
from gla_core.tpu import (
    NUM_LANES,
    NUM_SUBLANES,
    any_nonfinite,
    detect_races,
    interpret_params,
    pad_axis,
    round_up,
    unsupported_dtype_reason,
)
from gla_core.tpu_checks import (
    DEFAULT_SCOPED_VMEM_BYTES,
    KERNEL_VMEM_BUDGET_BYTES,
    CompileReport,
    compile_for_tpu,
    export_for_tpu,
)
from gla_core.validation import (
    attention_call,
    check_cu_seqlens,
    check_gate,
    check_state,
    is_concrete,
    require_bool,
    require_float,
    require_rank,
    require_shape,
    resolve_scale,
    validate,
    validate_common,
    validate_qkv,
)
from gla_core.varlen import ChunkLayout, build_chunk_layout, from_chunks, gather_chunks, num_padded_chunks, to_chunks


def op_spec(name: str) -> OpSpec:
    """The installed op `name` (its arguments record class is `op_spec(name).arguments`)."""
    return default_registry().op(name)


__all__ = [
    "ANCHOR_RANGE_OPTION",
    "ATTENTION_KEYWORDS",
    "BATCHED_NN",
    "BATCHED_NT",
    "BATCHED_TN",
    "BLOCK_CHUNKS_OPTION",
    "BLOCK_K_OPTION",
    "BLOCK_SIZE_OPTIONS",
    "BLOCK_V_OPTION",
    "CHUNK_SIZES",
    "CUMSUM_GATE_FLOOR",
    "DEFAULT_BLOCK_SIZES",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_SCOPED_VMEM_BYTES",
    "GATE_FLOOR",
    "INTERPRET_HINT",
    "KERNEL_CHUNK_OPTION",
    "KERNEL_VMEM_BUDGET_BYTES",
    "NN",
    "NT",
    "NUM_LANES",
    "NUM_SUBLANES",
    "STATE_POOL",
    "STATE_POOL_REASON",
    "STATE_V_FIRST",
    "TN",
    "AnchoredProducts",
    "BlockSizes",
    "BlockedProducts",
    "Call",
    "ChunkConfig",
    "ChunkLayout",
    "ChunkMasks",
    "CompileReport",
    "ContextParallelSpec",
    "HeadRows",
    "ImplOptions",
    "Implementation",
    "KernelInputs",
    "LevelProducts",
    "OpSpec",
    "Option",
    "ScalarGate",
    "StepDecays",
    "all_within",
    "any_nonfinite",
    "attention_call",
    "attention_spec",
    "bfloat16_parts",
    "block_sizes_of",
    "build_chunk_layout",
    "causal_dot",
    "check_cu_seqlens",
    "check_gate",
    "check_state",
    "chunk_bwd_dqkg",
    "chunk_cumsum",
    "chunk_fwd_h",
    "chunk_gated_attention",
    "column_to_row",
    "compile_for_tpu",
    "compiler_params",
    "cost_estimate",
    "declining_state_pool",
    "decode",
    "default_anchor_range",
    "define_chunk_vjp",
    "detect_races",
    "dispatch_by_name",
    "dot",
    "empty_attention",
    "export_for_tpu",
    "first_order_only",
    "floor_cumsum_gates",
    "floor_gates",
    "fold_vmap",
    "from_chunks",
    "gather_chunks",
    "has_no_tokens",
    "heads_per_group",
    "hookimpl",
    "host_boundaries",
    "interpret_params",
    "intra_costs",
    "is_concrete",
    "kernel_chunk_of",
    "kernel_inputs",
    "mask_table_inputs",
    "merge_heads",
    "multiple_of",
    "mxu_dtype",
    "num_padded_chunks",
    "op_gradients",
    "op_spec",
    "pad_axis",
    "positive_int",
    "prepare",
    "recompute_products",
    "require_bool",
    "require_float",
    "require_rank",
    "require_shape",
    "resolve_scale",
    "round_up",
    "row_to_column",
    "split_heads",
    "state_v_first_of",
    "swap_state_axes",
    "to_chunks",
    "two_sum",
    "unsupported_dtype_reason",
    "validate",
    "validate_common",
    "validate_qkv",
    "varlen",
    "with_state_layout",
]
