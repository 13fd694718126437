"""The per-key decays of all chunks of a grid step at once, and their anchored gated products.

A grid step of a chunk kernel walks n chunks. Written chunk by chunk, each chunk's matmuls wait
for the previous chunk's results (the carried state, or only the order of the refs), and the
matrix unit's result latency is paid a few times per chunk: libtpu's estimate of the per-key
forward spent three quarters of its cycles waiting. Here every quantity is formed for the n
chunks together, as batched matmuls over a leading chunk axis `[n, C, ...]`, so the latency is
paid once per phase of the step.

Anchored products. With b_t the sum of a chunk's log decays through step t and m its anchor row
(`KeyMaskTable.anchor_row`), D_t = b_t - b_m is a segment sum (one signed mask matmul, exact to
float32 accumulation accuracy), and

    e^{b_t - b_s} = e^{D_t} e^{-D_s},

so the intra-chunk scores `sum_k x_tk y_sk e^{b_tk - b_sk}` are one `[C, K] x [K, C]` product of
`x * e^{D}` and `y * e^{-D}`. The factors can exceed 1 and lose float32 accuracy as |D| grows, so
they are used only when every |D| of the step is at most the call's anchor range `r`
(`StepDecays.in_range`, False for NaN); the exponents are clipped to [-r, r] before `exp`, so
nothing overflows whatever the gates. Steps out of range (strong decays, hard resets, non-finite
gates) are recomputed by the kernels with the blocked products (anchored per sub-block of 16
steps, exact between them: `products.BlockedProducts`), or, where even a sub-block is out of
range, the exact level products (`products.LevelProducts`).

Accuracy inside the range: each exponent D carries an absolute float32 rounding of ~|D| 2^-24,
so a product's relative error is ~2 r 2^-24 (r = 8: 1e-6) on top of the operands' rounding to the
matrix unit's dtype (bfloat16: 2^-9, which allows a larger r).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_core.chunk.common import mask_dot, split_for_mask_dot
from gla_core.chunk.gates import KeyMaskTable
from gla_core.errors import InvalidArgumentError
from gla_core.options import Option

F32 = jnp.float32

# The largest |D| the anchored products accept by default, per matrix-unit dtype: bfloat16 operands
# round to 2^-9 anyway, float32 ones are held to float32 accuracy (2 r 2^-24 = 1e-6 at r = 8).
DEFAULT_ANCHOR_RANGE = {"bfloat16": 30.0, "float32": 8.0}


def default_anchor_range(dtype) -> float:
    """The default anchor range for a matrix-unit dtype (float32 for anything but bfloat16)."""
    return DEFAULT_ANCHOR_RANGE["bfloat16" if jnp.dtype(dtype) == jnp.bfloat16 else "float32"]


def _check_anchor_range(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 80:
        raise InvalidArgumentError(
            f"anchor_range: expected None (the default of the input dtype) or a number in [0, 80], got {value!r}"
        )
    return float(value)


# The per-call option of the chunk implementations (`impl_options={"chunk": {"anchor_range": 0}}`).
ANCHOR_RANGE_OPTION = Option(
    "anchor_range",
    None,
    _check_anchor_range,
    "per-key gate: largest in-chunk decay exponent of the anchored fast path, beyond it a step is "
    f"recomputed exactly (None: {DEFAULT_ANCHOR_RANGE['bfloat16']:g} for bfloat16, "
    f"{DEFAULT_ANCHOR_RANGE['float32']:g} for float32; 0: always exact)",
)


def all_within(exponents: jax.Array, bound: float) -> jax.Array:
    """Whether every |exponent| is <= bound: a scalar bool, False where an exponent is NaN (a float
    max of 0/1 flags, not a boolean reduction)."""
    return jnp.max(jnp.where(jnp.abs(exponents) <= bound, 0.0, 1.0)) == 0.0


class StepDecays:
    """The decays of the n chunks of one grid step for a per-key gate.

    Args:
      a: `[n*C, K]` float32 per-step log decays of the step (floored, `gates.floor_gates`).
      table_ref: the ref of the call's `KeyMaskTable`.
      chunk: C.
      anchor_range: r, the largest |D| of the anchored products (> 0), or None for a kernel that
        takes no gated products (then only the decays from the start, to the end and over the
        chunk are formed).
      scores_only: the kernel takes the gated products and nothing else (needs an anchor range):
        only the anchored exponents D are formed, a third of the segment-sum matmul, and the
        decays from the start or to the end raise.

    Quantities are computed when first used, so a kernel traces only what it needs.
    """

    def __init__(
        self, a: jax.Array, table_ref, chunk: int, anchor_range: float | None = None, *, scores_only: bool = False
    ):
        if anchor_range is not None and anchor_range <= 0:
            raise ValueError(f"anchor_range: expected a positive range, got {anchor_range}")
        if scores_only and anchor_range is None:
            raise InvalidArgumentError("scores_only: the anchored products need an anchor_range, got None")
        self.chunk = chunk
        self.num_chunks = a.shape[0] // chunk
        self.anchor_range = anchor_range
        parts = split_for_mask_dot(a).reshape(self.num_chunks, chunk, 3 * a.shape[1])
        first = KeyMaskTable.ANCHOR if anchor_range is not None else KeyMaskTable.THROUGH
        count = 1 if scores_only else KeyMaskTable.AFTER + 1 - first
        sums = mask_dot(table_ref[pl.ds(first * chunk, count * chunk), :], parts)  # [n, count*C, K]
        self._blocks = {
            block: sums[:, (block - first) * chunk : (block - first + 1) * chunk]
            for block in range(first, first + count)
        }
        self._anchored = self._blocks.get(KeyMaskTable.ANCHOR)  # D_t = b_t - b_m

    def _block(self, block: int, name: str) -> jax.Array:
        if block not in self._blocks:
            raise InvalidArgumentError(f"StepDecays: {name} is not formed for a kernel built with scores_only=True")
        return self._blocks[block]

    @property
    def _through(self) -> jax.Array:
        """b_t, [n, C, K]."""
        return self._block(KeyMaskTable.THROUGH, "the decay from the start")

    @property
    def _after(self) -> jax.Array:
        """b_L - b_t, [n, C, K]."""
        return self._block(KeyMaskTable.AFTER, "the decay to the end")

    @functools.cached_property
    def from_start(self) -> jax.Array:
        """e^{b_t}, [n, C, K]."""
        return jnp.exp(self._through)

    @functools.cached_property
    def to_end(self) -> jax.Array:
        """e^{b_L - b_t}, [n, C, K]."""
        return jnp.exp(self._after)

    @functools.cached_property
    def last_decay(self) -> jax.Array:
        """e^{b_L}, [n, 1, K]."""
        return jnp.exp(self._through[:, self.chunk - 1 :])

    @functools.cached_property
    def in_range(self) -> jax.Array:
        """Whether every |D| of the step is <= the anchor range (a scalar bool; False where a gate is NaN)."""
        return all_within(self._anchored, self._clip_bound)

    @functools.cached_property
    def _clipped(self) -> jax.Array:
        return jnp.clip(self._anchored, -self._clip_bound, self._clip_bound)

    @property
    def _clip_bound(self) -> float:
        if self.anchor_range is None:
            raise ValueError("anchor_range: StepDecays built without an anchor range takes no gated products")
        return self.anchor_range

    @functools.cached_property
    def row_factor(self) -> jax.Array:
        """e^{D_t}, the factor of the row operand (the later step t) of an anchored product, [n, C, K]."""
        return jnp.exp(self._clipped)

    @functools.cached_property
    def column_factor(self) -> jax.Array:
        """e^{-D_s}, the factor of the column operand (the earlier step s), [n, C, K]."""
        return jnp.exp(-self._clipped)
