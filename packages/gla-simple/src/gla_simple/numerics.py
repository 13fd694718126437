"""Small numeric building blocks of the XLA and recurrent implementations.

Everything here works in the compute dtype (float32, or float64 for float64 inputs): matmuls
accumulate in it at full precision (TPU's default f32 matmul would round operands to bf16), and
decays are only exponentiated once they are known to be <= 0 — masked entries are set to -inf
before `exp`.

Gates reach these helpers clamped at `LOG_DECAY_FLOOR` (see `floor_log_decays`): the cumulative
and segment sums below are triangular matmuls, where a -inf gate would meet a 0 of the mask
(0 · -inf = nan) and poison every sum of its chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32

# exp(LOG_DECAY_FLOOR) is exactly 0 in float32 and float64, and a chunk of 128 such gates sums to
# -1.3e32, still finite in float32: a clamped gate is a hard reset (decay exactly 0).
LOG_DECAY_FLOOR = -1e30


def compute_dtype(dtype) -> jnp.dtype:
    """The dtype the XLA and recurrent implementations compute in: float64 for float64 inputs, else float32."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(F32)


def floor_log_decays(g: jax.Array) -> jax.Array:
    """Log decays clamped at `LOG_DECAY_FLOOR`: -inf (a hard reset) becomes a finite value whose
    exp is still exactly 0, and whose gradient is exactly 0, as the recurrence's; nan stays nan."""
    return jnp.maximum(g, jnp.asarray(LOG_DECAY_FLOOR, g.dtype))


def einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`jnp.einsum` of two operands accumulated at full precision in their (promoted) dtype."""
    dtype = jnp.promote_types(a.dtype, b.dtype)
    return jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST, preferred_element_type=dtype)


def masked_exp(mask: jax.Array, x: jax.Array) -> jax.Array:
    """exp(x) where `mask`, exactly 0 elsewhere; masked-out x (possibly large) is never exponentiated.

    The mask is applied by adding -inf (x + -inf = -inf for any finite x, and exp(-inf) = 0)
    rather than by `jnp.where(mask, x, -inf)`: XLA:CPU in jax 0.10.2 crashes (segfault) at run
    time on some reductions over a select whose predicate is a broadcast mask.
    """
    return jnp.exp(x + jnp.where(mask, 0.0, -jnp.inf).astype(x.dtype))


def chunk_cumsum(x: jax.Array, exclusive: bool = False) -> jax.Array:
    """Cumulative sum over a chunk's time axis (-2) of x [..., C, X], anchored at the chunk start:
    y[t] = sum_{s <= t} x[s] (s < t when `exclusive`). A triangular matmul: one GEMM, cheaper to
    compile and run on CPU than a scan."""
    chunk = x.shape[-2]
    return einsum("ij,...jx->...ix", lower_triangle(chunk, exclusive).astype(x.dtype), x)


def reverse_chunk_cumsum(x: jax.Array, exclusive: bool = False) -> jax.Array:
    """Cumulative sum from the end of the time axis (-2): y[t] = sum_{s >= t} x[s] (s > t when `exclusive`)."""
    chunk = x.shape[-2]
    return einsum("ji,...jx->...ix", lower_triangle(chunk, exclusive).astype(x.dtype), x)


def segment_sums(x: jax.Array) -> jax.Array:
    """Pairwise sums over the time axis (-1) of x [..., C]: y[i, j] = sum_{j < s <= i} x[s] (0 for j >= i).

    Each entry is summed from its own terms (one GEMM against a constant [C, C, C] 0/1 mask), so a
    small sum is as precise as its terms even where the running sums are large; differences
    of cumulative sums lose that precision.
    """
    steps = jnp.arange(x.shape[-1])
    mask = (steps[None, :, None] < steps[None, None, :]) & (steps[None, None, :] <= steps[:, None, None])
    return einsum("ijs,...s->...ij", mask.astype(x.dtype), x)


def lower_triangle(size: int, strict: bool = False) -> jax.Array:
    """[size, size] bool mask of i >= j (i > j when `strict`)."""
    rows = jnp.arange(size)[:, None]
    cols = jnp.arange(size)[None, :]
    return rows > cols if strict else rows >= cols
