"""Static configuration shared by the kda chunk kernels: block sizes, dtypes, compiler parameters."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from gla_core.kit import NUM_SUBLANES, interpret_params

DEFAULT_SUB_CHUNK = 16


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the kda chunk kernels.

    Attributes:
      chunk_size: C, tokens per chunk (one grid step along time).
      sub_chunk: s, rows per sub-block. Decays inside a chunk are anchored at sub-block
        boundaries (no exponent is ever positive), and (I + Akk)^-1 is solved block by block.
        A multiple of 8 that divides C.
    """

    chunk_size: int = 64
    sub_chunk: int = DEFAULT_SUB_CHUNK

    def __post_init__(self):
        if self.sub_chunk % NUM_SUBLANES or self.chunk_size % self.sub_chunk:
            raise ValueError(
                f"sub_chunk: expected a multiple of {NUM_SUBLANES} dividing chunk_size={self.chunk_size}, "
                f"got {self.sub_chunk}"
            )

    @classmethod
    def for_chunk(cls, chunk_size: int) -> BlockSizes:
        """The default sub-block for a chunk size (the whole chunk when it is smaller than 16)."""
        return cls(chunk_size=chunk_size, sub_chunk=min(DEFAULT_SUB_CHUNK, chunk_size))

    @property
    def num_sub_chunks(self) -> int:
        return self.chunk_size // self.sub_chunk


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
    """

    blocks: BlockSizes
    scale: float
    group: int
    input_dtype: str
    interpret: bool = False

    @property
    def mxu_dtype(self):
        return jnp.dtype(self.input_dtype)

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


def compiler_params(sequential_time: bool):
    """Mosaic parameters for a (batch, value head, chunk) grid; time is "arbitrary" when sequential."""
    time = "arbitrary" if sequential_time else "parallel"
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", time))
