"""Pieces every chunk kernel family shares: block sizes, MXU matmuls, compiler params, costs.

Orientation used by all chunk kernels: states are stored transposed, `[V, K]` (the state
`S` of the recurrence is `[K, V]`), so a per-key decay is a row `[1, K]` that broadcasts
over the state's rows and `q @ S` is the natural `q @ state.T` matmul.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_core.ops import CHUNK_SIZES
from gla_core.options import ImplOptions, Option, multiple_of, positive_int
from gla_core.tpu import NUM_LANES

NN = (((1,), (0,)), ((), ()))  # a @ b
NT = (((1,), (1,)), ((), ()))  # a @ b.T
TN = (((0,), (0,)), ((), ()))  # a.T @ b
# The same with a leading batch axis n on both operands (e.g. the chunks of one grid iteration):
BATCHED_NN = (((2,), (1,)), ((0,), (0,)))  # [n, a, b] x [n, b, c] -> [n, a, c]
BATCHED_NT = (((2,), (2,)), ((0,), (0,)))  # [n, a, b] x [n, c, b] -> [n, a, c]
BATCHED_TN = (((1,), (1,)), ((0,), (0,)))  # [n, b, a] x [n, b, c] -> [n, a, c]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the chunk kernels (the time tile is the chunk size of the call).

    Attributes:
      block_v: the largest value-dimension tile of the kernels that tile V (fwd, fwd_h,
        bwd_dh, bwd_dv; they see all of K).
      block_k: the largest key-dimension tile of the dq/dk/dgate kernel (it sees all of V).
      block_chunks: the most chunks of one grid step of the sequential kernels (forward, states,
        state gradients; packed sequences too) and
        of the parallel backward kernels (dv and dq/dk/dgate): a grid step costs ~350 cycles of
        its own (libtpu's static estimate, v6e), a fifth of a chunk's work at C = 64. On the
        token-major kernels, the most chunks per head of one grid step.
      step_chunks: the token-major forward without a VJP: the most chunks of all heads together
        (H times the chunks per head) of one grid step (gla at H=16, C=64, v6e: 2.10x the HBM
        floor at 16, 1.83x at 32, 27 MB of VMEM).
      training_step_chunks: the same for the token-major forward that keeps scores and states for
        the backward, and for the backward, which hold more per chunk (at 32 the backward gains
        nothing and nears the VMEM budget).
    A padded dimension (a multiple of 128) is split into the largest multiple of 128 lanes
    that is <= the block size and divides it.
    """

    block_v: int = 256
    block_k: int = 256
    block_chunks: int = 4
    step_chunks: int = 32
    training_step_chunks: int = 16

    def __post_init__(self):
        for name in ("block_v", "block_k"):
            value = getattr(self, name)
            if value < NUM_LANES or value % NUM_LANES:
                raise ValueError(f"{name}: expected a positive multiple of {NUM_LANES}, got {value}")
        for name in ("block_chunks", "step_chunks", "training_step_chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive number of chunks, got {getattr(self, name)}")

    def value_tile(self, padded_value_dim: int) -> int:
        """The V tile for a padded value dimension (a multiple of 128)."""
        return _tile(self.block_v, padded_value_dim)

    def key_tile(self, padded_key_dim: int) -> int:
        """The K tile of the dq/dk/dgate kernel for a padded key dimension (a multiple of 128)."""
        return _tile(self.block_k, padded_key_dim)


def _tile(block: int, padded_dim: int) -> int:
    tile = min(block, padded_dim)
    while padded_dim % tile:
        tile -= NUM_LANES
    return tile


DEFAULT_BLOCK_SIZES = BlockSizes()
# The per-call tile options of the Pallas implementations (`impl_options={"chunk": {"block_v": 128}}`).
BLOCK_V_OPTION = Option(
    "block_v", DEFAULT_BLOCK_SIZES.block_v, multiple_of("block_v", NUM_LANES), "largest V tile (state, output)"
)
BLOCK_K_OPTION = Option(
    "block_k", DEFAULT_BLOCK_SIZES.block_k, multiple_of("block_k", NUM_LANES), "largest K tile (dq, dk, dgate)"
)
BLOCK_CHUNKS_OPTION = Option(
    "block_chunks",
    DEFAULT_BLOCK_SIZES.block_chunks,
    positive_int("block_chunks"),
    "most chunks per grid step (every kernel)",
    candidates=(1, 2, 4, 8),
)

STEP_CHUNKS_OPTION = Option(
    "step_chunks",
    DEFAULT_BLOCK_SIZES.step_chunks,
    positive_int("step_chunks"),
    "token-major forward without a VJP: most chunks of all heads together per grid step",
    candidates=(8, 16, 32, 64),
)
TRAINING_STEP_CHUNKS_OPTION = Option(
    "training_step_chunks",
    DEFAULT_BLOCK_SIZES.training_step_chunks,
    positive_int("training_step_chunks"),
    "token-major forward for a VJP and backward: most chunks of all heads together per grid step",
    candidates=(8, 16, 32),
)
BLOCK_SIZE_OPTIONS = (
    BLOCK_V_OPTION,
    BLOCK_K_OPTION,
    BLOCK_CHUNKS_OPTION,
    STEP_CHUNKS_OPTION,
    TRAINING_STEP_CHUNKS_OPTION,
)


def _check_kernel_chunk(value) -> int | None:
    if value is None:
        return None
    return positive_int("kernel_chunk", CHUNK_SIZES)(value)


# Every chunk size computes the same function up to rounding, so the kernels' chunk is a tuning knob:
# the per-chip table sets it where a larger chunk fills the MXU better (v6e: 128 for gla).
KERNEL_CHUNK_OPTION = Option(
    "kernel_chunk",
    None,
    _check_kernel_chunk,
    f"the kernels' chunk, in place of the call's chunk_size (None: the call's; one of {CHUNK_SIZES})",
    candidates=(64, 128),
)


def kernel_chunk_of(options: ImplOptions, chunk_size: int) -> int:
    """The chunk the kernels use: the `kernel_chunk` option when set, else the call's `chunk_size`."""
    chosen = options.get("kernel_chunk")
    return chunk_size if chosen is None else chosen


def block_sizes_of(options: ImplOptions) -> BlockSizes:
    """The tiles a call's options ask for (`BLOCK_SIZE_OPTIONS`), defaults for the others."""
    return BlockSizes(
        **{
            option.name: options.get(option.name, getattr(DEFAULT_BLOCK_SIZES, option.name))
            for option in BLOCK_SIZE_OPTIONS
        }
    )


def mxu_dtype(dtype) -> jnp.dtype:
    """The dtype fed to the MXU for inputs of `dtype`: bfloat16 stays, everything else is float32."""
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(jnp.float32)


def dot(a: jax.Array, b: jax.Array, dims, dtype) -> jax.Array:
    """`dot_general(a, b, dims)` with both operands cast to the MXU dtype, accumulated in float32.

    float32 operands use full float32 contraction precision.
    """
    dtype = jnp.dtype(dtype)
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    return jax.lax.dot_general(
        a.astype(dtype), b.astype(dtype), dims, precision=precision, preferred_element_type=jnp.float32
    )


def bfloat16_parts(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Three bfloat16 arrays whose float32 sum is the float32 `x` exactly (8 significant bits each)."""
    high = x.astype(jnp.bfloat16)
    rest = x - high.astype(jnp.float32)
    middle = rest.astype(jnp.bfloat16)
    low = (rest - middle.astype(jnp.float32)).astype(jnp.bfloat16)
    return high, middle, low


def split_for_mask_dot(x: jax.Array) -> jax.Array:
    """float32 `x` [..., N, K] as its three bfloat16 parts side by side, [..., N, 3K] (`mask_dot`'s operand)."""
    return jnp.concatenate(bfloat16_parts(x), axis=-1)


def mask_dot(masks: jax.Array, parts: jax.Array) -> jax.Array:
    """`masks @ x` for every one of M operands, as accurate as a float32 matmul in half its passes.

    Args:
      masks: `[R, N]` 0/1 (or +-1) masks, exact in bfloat16, shared by the operands.
      parts: `[M, N, 3K]`, the three bfloat16 parts of float32 operands x `[M, N, K]`
        (`split_for_mask_dot`, so that several masks share one split).

    Returns:
      `[M, R, K]` float32. Every product of a mask entry and a part is exact, so only the float32
      accumulation rounds: three bfloat16 passes (one matmul of the parts side by side) where a
      float32 matmul at full precision takes six.
    """
    count = parts.shape[0]
    keys = parts.shape[2] // 3
    masks = jnp.broadcast_to(masks.astype(jnp.bfloat16)[None], (count, *masks.shape))
    sums = jax.lax.dot_general(masks, parts, BATCHED_NN, preferred_element_type=jnp.float32)
    return (sums[..., :keys] + sums[..., keys : 2 * keys]) + sums[..., 2 * keys :]


def compiler_params(*semantics: str, vmem_limit_bytes: int | None = None) -> pltpu.CompilerParams:
    """Mosaic compiler parameters with the given grid dimension semantics and, when given, the
    scoped VMEM limit (Mosaic's per-chip default otherwise)."""
    return pltpu.CompilerParams(dimension_semantics=tuple(semantics), vmem_limit_bytes=vmem_limit_bytes)


def nbytes(*arrays) -> int:
    """Total bytes of arrays or shape structs (None entries count zero)."""
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays if a is not None)


def cost_estimate(flops: int, transcendentals: int, arrays) -> pl.CostEstimate:
    """A `pl.CostEstimate` whose bytes are the sizes of every input and output of the kernel."""
    return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals), bytes_accessed=nbytes(*arrays))


def chunk_iota(chunk: int) -> tuple[jax.Array, jax.Array]:
    """Row and column indices `[C, C]` (int32) of a chunk-by-chunk tile."""
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    return rows, cols


def _diagonal(size: int) -> jax.Array:
    rows, cols = chunk_iota(size)
    return rows == cols


def column_to_row(col: jax.Array, diagonal: jax.Array | None = None) -> jax.Array:
    """`[C, 1]` to `[1, C]` exactly (diagonal select and sublane sum; no transpose op).

    `diagonal`: the `[C, C]` bool identity mask, when the caller already has one.
    """
    diagonal = _diagonal(col.shape[0]) if diagonal is None else diagonal
    return jnp.sum(jnp.where(diagonal, col, 0.0), axis=0, keepdims=True)


def row_to_column(row: jax.Array, diagonal: jax.Array | None = None) -> jax.Array:
    """`[1, C]` to `[C, 1]` exactly (diagonal select and lane sum; no transpose op).

    `diagonal`: the `[C, C]` bool identity mask, when the caller already has one.
    """
    diagonal = _diagonal(row.shape[1]) if diagonal is None else diagonal
    return jnp.sum(jnp.where(diagonal, row, 0.0), axis=1, keepdims=True)


def causal_dot(scores: jax.Array, x: jax.Array, dtype, causal: jax.Array | None = None) -> jax.Array:
    """`scores @ x` for causal `scores` [C, C] (zero for s > t) and `x` [C, N], float32, where row t
    sees `x_s` only for s <= t even when `x_s` is not finite.

    A matmul multiplies the zeros above the diagonal with `x_s` too, and `0 * NaN = NaN` would carry
    a NaN or Inf at step s into every earlier row. So the product takes `x` with its non-finite
    entries zeroed, and every row at or after a step holding one is NaN (the recurrence's state is
    not finite from that step on). `causal`: the `[C, C]` bool mask t >= s, when the caller has one.
    """
    finite = jnp.isfinite(x.astype(jnp.float32))  # Mosaic tests finiteness of float32 only
    product = dot(scores, jnp.where(finite, x, jnp.zeros((), x.dtype)), NN, dtype)
    rows, cols = chunk_iota(x.shape[0])
    causal = rows >= cols if causal is None else causal
    bad = column_to_row(jnp.max(jnp.where(finite, 0.0, 1.0), axis=1, keepdims=True), rows == cols)  # [1, C]
    reached = jnp.max(jnp.where(causal, bad, 0.0), axis=1, keepdims=True)  # [C, 1]: a bad step s <= t
    return jnp.where(reached > 0.0, jnp.nan, product)
