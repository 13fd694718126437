"""Static configuration shared by the kda chunk kernels: block sizes, dtypes, compiler parameters."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_core.errors import InvalidArgumentError
from gla_core.kit import NUM_SUBLANES, default_anchor_range, interpret_params

DEFAULT_SUB_CHUNK = 16
# Sub-block of the gradient kernel (`intra_bwd`): its off-diagonal sub-blocks take elementwise work
# over every row before each sub-block (C^2 / 2s rows per chunk), its diagonal ones one masked
# [C, C] product whatever s is. v6e static estimate of the kernel at B=1 T=2048 H=4 (training,
# 2 heads x 2 chunks per step): 136.8k cycles at s = 8, 108.2k at 16, 95.8k at 32, 91.9k at 64.
# 32 keeps the anchored diagonal sub-blocks valid up to about 2 per step of |g| in bfloat16
# (an exponent range of 30 over 16 steps either side of the middle row).
DEFAULT_GRAD_SUB_CHUNK = 32
DEFAULT_CHUNKS_PER_STEP = 8
# Chunks per grid step of the forward intra-chunk kernel (`intra`): its chunks are independent, and
# their blocked inverses' dependent chains interleave. v6e static estimate of the kernel at
# B=2 T=4096 H=16: 583.6k cycles with 8 chunks per step, 532.9k with 16 (32.8 MiB of VMEM with
# 8-row inverse blocks); 32 does not fit in the 48 MiB budget.
DEFAULT_INTRA_CHUNKS_PER_STEP = 16
# Rows of the diagonal blocks of (I + Akk)^-1 that the forward eliminates on the vector unit
# before joining them by matrix products (`chunk_math.unit_lower_inverses`): 8 rows are one
# float32 vector register, 7 elimination steps and 56 broadcast rows per matrix where 16 take 15
# and 240, for one more level of joins. kda_intra at B=2 T=4096 H=16, v6e: 583.6k cycles with
# 16-row blocks, 568.7k with 8 (8 chunks per step).
DEFAULT_INVERSE_BLOCK = 8
# Value heads per grid step of the forward state recurrence: their chains of dependent matrix
# products interleave, issued stage by stage over the heads (`state.wy_deltas`). The v6e static
# estimate of the kernel alone at B=1 T=2048 H=4 (chunks of 128): 32.7k cycles with 2 heads per
# step, 27.2k with 4; at H=8, 53.3k with 8 (twice the VMEM of 4).
DEFAULT_STATE_HEADS_PER_STEP = 4
# The same for the reverse state-gradient recurrence (`state_bwd`), measured on its own (v6e static
# estimate, B=1 T=2048 H=4): 24.8k cycles with 2 heads per step, 26.1k with 4.
DEFAULT_STATE_GRAD_HEADS_PER_STEP = 2
# Value heads and chunks per grid step of the per-chunk gradient kernel (`intra_bwd`): the heads'
# carried state chains interleave as in the state kernels. v6e static estimate of the kernel in
# the training step at B=1 T=2048 H=4 (chunks of 128), heads x chunks: 2 x 2 87.5k cycles,
# 4 x 1 81.5k, 4 x 2 102.0k, 1 x 4 98.7k; at H=8, 8 x 1 229.5k against 164.2k at 4 x 1. At the
# cost report's shapes 2 x 2 and 4 x 1 tie on fixed-length rows (B=2 T=4096 H=16: 1,238,921 against
# 1,233,296 cycles; B=1 T=8192 H=32: 2,456,203 against 2,434,707) and 2 x 2 wins on a packed row of
# 4 sequences in T=8192, H=16 (1,379,146 against 1,474,741); both chips' tables take 2 x 2.
DEFAULT_GRAD_HEADS_PER_STEP = 2
DEFAULT_GRAD_CHUNKS_PER_STEP = 2


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the kda chunk kernels (the `chunk` implementation sets the chunk and the counts
    from its per-call options, `gla_kda.chunk.OPTIONS`).

    Attributes:
      chunk_size: C, tokens per chunk (one grid step along time).
      sub_chunk: s, rows per sub-block. Decays inside a chunk are anchored at sub-block
        boundaries (no exponent is ever positive). A multiple of 8 that divides C.
      grad_sub_chunk: the same for the gradient kernel (`intra_bwd`), which sets it apart; None
        (the default) for min(32, C).
      inverse_block: rows of the diagonal blocks of (I + Akk)^-1 solved on the vector unit before
        the blocked joins; None (the default) for min(8, C).
      chunks_per_step: the most chunks one grid step processes (fewer per-step overheads;
        in the parallel kernels, independent chains the scheduler interleaves). `per_step`
        picks the largest divisor of the chunk count not above it (a packed row's chunk count
        is rounded up to split evenly, `gla_core.varlen.even_step_chunks`).
      intra_chunks_per_step: the same for the forward intra-chunk kernel.
      grad_chunks_per_step: the same for the per-chunk gradient kernel.
      state_heads_per_step: the most value heads one grid step of the forward state recurrence
        takes (a divisor of HV; 1 when value heads share q/k heads).
      state_grad_heads_per_step: the same for the reverse state-gradient recurrence.
      grad_heads_per_step: the same for the per-chunk gradient kernel; its VMEM grows with
        grad_heads_per_step * grad_chunks_per_step (K = V = 128: 19.4 MiB at 2 x 2, 37.7 MiB
        at 2 x 4).
    """

    chunk_size: int = 64
    sub_chunk: int = DEFAULT_SUB_CHUNK
    grad_sub_chunk: int | None = None
    inverse_block: int | None = None
    chunks_per_step: int = DEFAULT_CHUNKS_PER_STEP
    intra_chunks_per_step: int = DEFAULT_INTRA_CHUNKS_PER_STEP
    grad_chunks_per_step: int = DEFAULT_GRAD_CHUNKS_PER_STEP
    state_heads_per_step: int = DEFAULT_STATE_HEADS_PER_STEP
    state_grad_heads_per_step: int = DEFAULT_STATE_GRAD_HEADS_PER_STEP
    grad_heads_per_step: int = DEFAULT_GRAD_HEADS_PER_STEP

    def __post_init__(self):
        for name, default in (("grad_sub_chunk", DEFAULT_GRAD_SUB_CHUNK), ("inverse_block", DEFAULT_INVERSE_BLOCK)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, min(default, self.chunk_size))
        for name in ("sub_chunk", "grad_sub_chunk", "inverse_block"):
            sub = getattr(self, name)
            if sub % NUM_SUBLANES or self.chunk_size % sub:
                raise InvalidArgumentError(
                    f"{name}: expected a multiple of {NUM_SUBLANES} dividing chunk_size={self.chunk_size}, got {sub}"
                )
        for name in (
            "chunks_per_step",
            "intra_chunks_per_step",
            "grad_chunks_per_step",
            "state_heads_per_step",
            "state_grad_heads_per_step",
            "grad_heads_per_step",
        ):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name}: expected a positive count, got {getattr(self, name)}")

    @classmethod
    def for_chunk(cls, chunk_size: int, **counts: int) -> BlockSizes:
        """The default sub-block for a chunk size (the whole chunk when it is smaller than 16), and
        the given per-step `counts` (chunks_per_step=..., ...; defaults for the others)."""
        return cls(chunk_size=chunk_size, sub_chunk=min(DEFAULT_SUB_CHUNK, chunk_size), **counts)

    @property
    def num_sub_chunks(self) -> int:
        return self.chunk_size // self.sub_chunk

    def per_step(self, num_chunks: int, most: int | None = None) -> int:
        """Chunks per grid step for a sequence of `num_chunks` chunks: a divisor of it, at most
        `most` (default `chunks_per_step`)."""
        most = self.chunks_per_step if most is None else most
        return max(n for n in range(1, min(most, num_chunks) + 1) if num_chunks % n == 0)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Everything static about one run of the kda chunk pipeline.

    Attributes:
      blocks: tile sizes.
      scale: the attention scale; the kernels multiply q by it right after loading it, and
        the backward multiplies dq by it once at the end (the only two places).
      group: m = HV // H; value head j reads q/k head j // m.
      input_dtype: dtype name of q, k, v; matrix-unit operands use it (f32 accumulation).
      interpret: run the kernels in TPU interpret mode.
      anchor_range: the `anchor_range` option (gla-core's): None for the default of the
        matrix-unit dtype, 0 for the exact gated products everywhere (`anchor`).
    """

    blocks: BlockSizes
    scale: float
    group: int
    input_dtype: str
    interpret: bool = False
    anchor_range: float | None = None

    @property
    def anchor(self) -> float | None:
        """The largest decay exponent |D| of the anchored gated products (`intra`, and the diagonal
        sub-blocks of `intra_bwd`), beyond which a grid step is recomputed exactly; None when every
        step takes the exact products."""
        anchor = default_anchor_range(self.mxu_dtype) if self.anchor_range is None else self.anchor_range
        return anchor if anchor > 0 else None

    @property
    def mxu_dtype(self):
        return jnp.dtype(self.input_dtype)

    @property
    def compensated_decays(self) -> bool:
        """Whether the state kernels take the decays' within-chunk cumsum compensated
        (`chunk_math.Decays`): for float32 inputs. With bfloat16 inputs every exponent they form
        scales a matrix-unit operand rounded to bfloat16, and hi alone errs below that rounding
        (`chunk_math.Decays`); the compensation would cost a fifth of their time (v6e static
        estimate at B=2 T=4096 H=16: kda_state 469k cycles compensated, 370k without;
        kda_state_bwd 493k, 428k)."""
        return self.mxu_dtype == jnp.float32

    @property
    def store_dtype(self):
        """dtype of the per-chunk states and delta tensors kept in HBM between kernels.

        float32 for float32 inputs; the input dtype otherwise (they only feed the matrix
        unit in that dtype), which halves HBM traffic for bf16.
        """
        return jnp.dtype(self.input_dtype)

    @property
    def unroll(self) -> bool:
        """Unroll the in-kernel loops over sub-block positions (on TPU; interpret mode compiles faster rolled).

        Unrolled loops pick rows with static slices; `tests/pallas/test_chunk_units.py` checks
        both forms against float64 numpy.
        """
        return not self.interpret

    @property
    def interpret_arg(self):
        return interpret_params(self.interpret)


def compiler_params(sequential_time: bool, vmem_limit_bytes: int | None = None):
    """Mosaic parameters for a (batch, value head, chunk) grid; time is "arbitrary" when sequential.
    `vmem_limit_bytes`: the kernel's scoped VMEM limit (None: the chip's default)."""
    time = "arbitrary" if sequential_time else "parallel"
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", time), vmem_limit_bytes=vmem_limit_bytes)


def token_block(rows: int, dim: int, group: int = 1, num_steps: int | None = None):
    """Block [rows, dim] of a token-major `[B, Tp, H*dim]` array for grid step (b, j, t) of a
    (batch, value head, time) grid: rows t*rows.. of head j // group (dim a multiple of 128, so
    a head's lanes are one block). Scalar-prefetch refs after the grid indices are ignored.
    `num_steps`: the grid's time steps when it walks time backwards (step t reads rows
    (num_steps - 1 - t)*rows..); None when it walks forwards.
    """

    def index(b, j, t, *_):
        head = j if group == 1 else jax.lax.div(j, jnp.int32(group))
        return (b, t if num_steps is None else num_steps - 1 - t, head)

    return pl.BlockSpec((None, rows, dim), index)


def head_index(head: int, heads: int, rank: int, num_steps: int | None = None):
    """Index map of the one-head block of head `head` of the `heads` value heads of grid step (b, j, t)
    in a head-major [B, HV, T-blocks, ...] array of `rank` dimensions: value head j * heads + head,
    time block t (num_steps - 1 - t when the grid walks time backwards, as in `token_block`),
    trailing block indices 0."""

    def index(b, j, t, *_):
        return (b, j * heads + head, t if num_steps is None else num_steps - 1 - t) + (0,) * (rank - 3)

    return index


def head_blocks(heads: int, *block: int):
    """One block `block` (trailing dims) of a head-major `[B, HV, ...]` array per head of the `heads`
    value heads of grid step (b, j, t) of a (batch, value head, time) grid that walks time
    forwards: value head j * heads + i, time block t (`head_index`)."""
    return [pl.BlockSpec((None, None, *block), head_index(i, heads, 2 + len(block))) for i in range(heads)]


def head_block(*block: int):
    """`head_blocks` of one value head per grid step: value head j, time block t."""
    (spec,) = head_blocks(1, *block)
    return spec
