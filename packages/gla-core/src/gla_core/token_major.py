"""Per-head rows of the op's token-major arrays inside a kernel, without a layout copy.

The ops take `[B, T, H, D]`. Merging T and H gives `[B, T*H, D]`, which is a free view (a
bitcast in XLA) whenever each token's `[H, D]` slab fills whole sublane tiles: H a multiple of
16 for 16-bit dtypes, of 8 for 32-bit ones (other H cost XLA one copy, nothing else changes).
A kernel reads blocks `[1, Tb*H, D]` of that view, all heads of Tb tokens in one large DMA and
one grid step, and takes one head's rows `[n, D]` (every H-th row) with a strided load.

16-bit dtypes pack row pairs into 32-bit words (rows 2i and 2i+1 of the block, the even row in
the low half), so a single head's rows are not 32-bit addressable and Mosaic cannot load them
with a stride. They are read in head pairs (h, h+1), h even: for the even tokens of the chunk
the words with stride H starting at row h/2 of the 32-bit view, for the odd tokens the words
starting H/2 rows later; two shifts and masks turn them into each head's packed `[n, D]` rows.
Writes go the same way. TPU interpret mode has no bitcast refs; there the same rows are read
and written with plain 16-bit strided loads and stores (the semantics of the 32-bit form are
JAX's definition of a TPU bitcast, see `pltpu.bitcast`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

U32 = jnp.uint32
LOW_HALF = 0xFFFF
HIGH_HALF = 0xFFFF0000


def merge_heads(x: jax.Array) -> jax.Array:
    """`[B, T, H, D]` to the kernels' `[B, T*H, D]` view."""
    b, t, h, d = x.shape
    return x.reshape(b, t * h, d)


def split_heads(y: jax.Array, num_heads: int) -> jax.Array:
    """The kernels' `[B, T*H, D]` back to `[B, T, H, D]`."""
    b, rows, d = y.shape
    return y.reshape(b, rows // num_heads, num_heads, d)


def heads_per_group(dtype) -> int:
    """How many heads one load serves: 2 for packed 16-bit dtypes (a head pair), else 1."""
    return 2 if jnp.dtype(dtype).itemsize == 2 else 1


class HeadRows:
    """One head group's rows of a `[1, Tb*H, D]` block ref (row `t*H + h` is token t, head h).

    Args:
      ref: the block ref.
      num_heads: H (even for 16-bit dtypes).
      interpret: the kernel runs in TPU interpret mode (plain strided loads and stores).
    Token offsets and head indices must be static Python ints: Mosaic proves the alignment of
    a strided access only for static starts.
    """

    def __init__(self, ref, num_heads: int, interpret: bool):
        self.ref = ref
        self.num_heads = num_heads
        self.interpret = interpret
        self.group = heads_per_group(ref.dtype)
        if self.group == 2 and num_heads % 2:
            raise ValueError(f"num_heads: a 16-bit block needs an even head count, got {num_heads}")
        if self.group == 2 and not interpret:
            tokens = ref.shape[1] // num_heads
            self._words = ref.bitcast(U32).reshape(tokens * num_heads // 2, ref.shape[-1])

    def _rows(self, first_token: int, tokens: int, head: int, stride_tokens: int = 1):
        return pl.ds(first_token * self.num_heads + head, tokens, stride=self.num_heads * stride_tokens)

    def load(self, first_token: int, tokens: int, head: int) -> tuple[jax.Array, ...]:
        """Rows `[tokens, D]` of heads `head .. head + group - 1` (head a multiple of the group)."""
        if self.group == 1 or self.interpret:
            return tuple(self.ref[0, self._rows(first_token, tokens, h), :] for h in range(head, head + self.group))
        half = self.num_heads // 2
        start = first_token * half + head // 2
        even = self._words[pl.ds(start, tokens // 2, stride=self.num_heads), :]  # tokens 2i: (head, head+1)
        odd = self._words[pl.ds(start + half, tokens // 2, stride=self.num_heads), :]  # tokens 2i+1
        first = (even & U32(LOW_HALF)) | (odd << 16)
        second = (even >> 16) | (odd & U32(HIGH_HALF))
        return pltpu.bitcast(first, self.ref.dtype), pltpu.bitcast(second, self.ref.dtype)

    def store(self, first_token: int, head: int, values: tuple[jax.Array, ...]) -> None:
        """Writes rows `[tokens, D]` of heads `head ..` (one array per head of the group), cast to
        the ref's dtype."""
        values = tuple(x.astype(self.ref.dtype) for x in values)
        if self.group == 1 or self.interpret:
            for h, x in zip(range(head, head + self.group), values, strict=True):
                self.ref[0, self._rows(first_token, x.shape[0], h), :] = x
            return
        first, second = (pltpu.bitcast(x, U32) for x in values)  # words (token 2i, token 2i+1) of one head
        half = self.num_heads // 2
        start = first_token * half + head // 2
        pairs = first.shape[0]
        self._words[pl.ds(start, pairs, stride=self.num_heads), :] = (first & U32(LOW_HALF)) | (second << 16)
        self._words[pl.ds(start + half, pairs, stride=self.num_heads), :] = (first >> 16) | (second & U32(HIGH_HALF))
