"""The token-major layout of the per-key chunk kernels: the op's own arrays, all heads per grid step.

The op's `[B, T, H, D]` arrays are read and written through the free `[B, T*H, D]` view
(`gla_core.token_major`): a grid step of the token-major kernels takes n chunks of all H heads,
one block `[1, n*C*H, D]` per array (row `t*H + h` is token t of head h), and reads each head's
rows with strided loads (`HeadRows`, head pairs for 16-bit dtypes). In a step the heads' rows
become `[H*n, C, D]` operands, head-major (head h's chunks are rows h*n .. h*n + n - 1), as
`step_math` takes them; results go back the same way. No transposed or padded copy of q, k, v,
the gate, o or any gradient is made in HBM.

The kernels' own tensors: states `[B, NT, H, V, K]` (transposed per head, as in the head-major
kernels), intra-chunk scores `[B, NT, H, C, C]`, per-sequence states `[B, H, V, K]`; a step's
per-chunk blocks `[n, H, ...]` become head-major `[H*n, ...]` with `heads_first`.

A scalar gate (one log decay per token and head) is read as `[1, n*C, H]` blocks of the op's own
`[B, T, H]` array and broadcast over the keys in VMEM, so the per-key math serves it unchanged; its
gradient is summed over the keys before it is written.

`TokenGeometry` decides whether a call can take this layout (`fits`): fixed length, T a
multiple of the chunk, K and V multiples of 128 lanes, an even H for 16-bit inputs. Others take
the head-major kernels.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_core.chunk.common import compiler_params
from gla_core.token_major import HeadRows, heads_per_group
from gla_core.tpu import KERNEL_VMEM_BUDGET_BYTES, NUM_LANES, interpret_params


@dataclasses.dataclass(frozen=True)
class TokenGeometry:
    """Static sizes of a token-major call.

    Attributes:
      seq_len, num_heads, key_dim, value_dim: the op's sizes (the batch is the arrays' first axis, which
        `jax.vmap` folds into).
      chunk: C; chunks_per_step: n (a divisor of T / C).
      reverse: the time grid axis runs from the last step to the first.
      interpret: TPU interpret mode (plain strided loads, see `HeadRows`).
      scalar_gate: the gate is one log decay per token and head, `[B, T, H]` (simple_gla's g and
        g_gamma), rather than per key, `[B, T*H, K]` (gla's gk).
    """

    seq_len: int
    num_heads: int
    key_dim: int
    value_dim: int
    chunk: int
    chunks_per_step: int
    reverse: bool = False
    interpret: bool = False
    scalar_gate: bool = False

    @staticmethod
    def fits(seq_len: int, num_heads: int, key_dim: int, value_dim: int, chunk: int, dtype) -> bool:
        """Whether a fixed-length call of these sizes can take the token-major kernels."""
        return (
            seq_len % chunk == 0
            and key_dim % NUM_LANES == 0
            and value_dim % NUM_LANES == 0
            and num_heads % heads_per_group(dtype) == 0
        )

    @property
    def num_chunks(self) -> int:
        return self.seq_len // self.chunk

    @property
    def num_steps(self) -> int:
        return self.num_chunks // self.chunks_per_step

    @property
    def step_rows(self) -> int:
        """Rows of one time block of the `[B, T*H, D]` view: n*C tokens of all heads."""
        return self.chunks_per_step * self.chunk * self.num_heads

    def grid(self, batch: int) -> tuple[int, int]:
        """(batch rows, time steps)."""
        return batch, self.num_steps

    def _time(self, t):
        return self.num_steps - 1 - t if self.reverse else t

    def rows(self, dim: int) -> pl.BlockSpec:
        """A time block `[1, n*C*H, D]` of a `[B, T*H, D]` view."""
        return pl.BlockSpec((1, self.step_rows, dim), lambda b, t: (b, self._time(t), 0))

    def gate_rows(self, key_dim: int) -> pl.BlockSpec:
        """A time block of the gate: `[1, n*C*H, K]` of the per-key view, `[1, n*C, H]` of a scalar gate."""
        if self.scalar_gate:
            return pl.BlockSpec(
                (1, self.chunks_per_step * self.chunk, self.num_heads), lambda b, t: (b, self._time(t), 0)
            )
        return self.rows(key_dim)

    def per_chunk(self, *block: int) -> pl.BlockSpec:
        """The step's chunks of every head, `[n, H, *block]` of a `[B, NT, H, *block]` array (one
        contiguous block: libtpu's static model estimates blocks strided over heads at 0 cycles)."""
        zeros = (0,) * len(block)

        def per_chunk_index(b, t):
            return b, self._time(t), 0, *zeros

        return pl.BlockSpec((None, self.chunks_per_step, self.num_heads, *block), per_chunk_index)

    def per_sequence(self) -> pl.BlockSpec:
        """The states of a batch row, `[H, V, K]` of `[B, H, V, K]` (the same block every step)."""
        return pl.BlockSpec((None, self.num_heads, self.value_dim, self.key_dim), lambda b, t: (b, 0, 0, 0))


def load_heads(ref, geo: TokenGeometry, dtype=None, heads: range | None = None) -> jax.Array:
    """The rows of `heads` (default: every head; a range of whole head groups) of a `[1, n*C*H, D]`
    block as `[len(heads)*n, C, D]` (cast to `dtype` if given)."""
    rows = HeadRows(ref, geo.num_heads, geo.interpret)
    heads = range(geo.num_heads) if heads is None else heads
    tokens = geo.chunks_per_step * geo.chunk
    loaded = [x for head in range(heads.start, heads.stop, rows.group) for x in rows.load(0, tokens, head)]
    value = jnp.stack(loaded)  # [len(heads), n*C, D]
    if dtype is not None:
        value = value.astype(dtype)
    return value.reshape(len(heads) * geo.chunks_per_step, geo.chunk, value.shape[-1])


def store_heads(ref, value: jax.Array, geo: TokenGeometry, heads: range | None = None) -> None:
    """Writes `[len(heads)*n, C, D]` as the rows of `heads` (default: every head) of a `[1, n*C*H, D]`
    block (cast to its dtype)."""
    rows = HeadRows(ref, geo.num_heads, geo.interpret)
    heads = range(geo.num_heads) if heads is None else heads
    per_head = value.reshape(len(heads), geo.chunks_per_step * geo.chunk, value.shape[-1])
    for head in range(heads.start, heads.stop, rows.group):
        first = head - heads.start
        rows.store(0, head, tuple(per_head[h] for h in range(first, first + rows.group)))


def load_gate(ref, geo: TokenGeometry, key_dim: int, heads: range | None = None) -> jax.Array:
    """The step's log decays per key, `[H*n, C, K]` float32 (a scalar gate broadcast over the keys);
    a per-key gate's may be those of `heads` only."""
    if not geo.scalar_gate:
        return load_heads(ref, geo, heads=heads)
    if heads is not None and len(heads) != geo.num_heads:
        raise ValueError(f"heads: a scalar gate is loaded for every head, got {heads}")
    gate = ref[0]  # [n*C, H]
    lanes = jax.lax.broadcasted_iota(jnp.int32, gate.shape, 1)
    tokens = gate.shape[0]
    columns = [jnp.sum(jnp.where(lanes == h, gate, 0.0), axis=1, keepdims=True) for h in range(geo.num_heads)]
    per_key = jnp.stack([jnp.broadcast_to(column, (tokens, key_dim)) for column in columns])  # [H, n*C, K]
    return per_key.reshape(geo.num_heads * geo.chunks_per_step, geo.chunk, key_dim)


def store_gate_grad(ref, grad: jax.Array, geo: TokenGeometry, heads: range | None = None) -> None:
    """Writes the gradient of the log decays per key `[H*n, C, K]` float32: per key (of `heads` only,
    if given), or for a scalar gate (every head) summed over the keys into the `[1, n*C, H]` block."""
    if not geo.scalar_gate:
        store_heads(ref, grad, geo, heads)
        return
    if heads is not None and len(heads) != geo.num_heads:
        raise ValueError(f"heads: a scalar gate's gradient is stored for every head, got {heads}")
    tokens = geo.chunks_per_step * geo.chunk
    per_head = jnp.sum(grad, axis=-1, keepdims=True).reshape(geo.num_heads, tokens, 1)
    lanes = jax.lax.broadcasted_iota(jnp.int32, (tokens, geo.num_heads), 1)
    block = jnp.zeros((tokens, geo.num_heads), jnp.float32)
    for h in range(geo.num_heads):
        block = jnp.where(lanes == h, per_head[h], block)
    ref[0] = block


def heads_first(block: jax.Array) -> jax.Array:
    """A per-chunk block `[n, H, ...]` as `[H*n, ...]` (head h's chunks at rows h*n ..)."""
    chunks, heads = block.shape[:2]
    return jnp.swapaxes(block, 0, 1).reshape(heads * chunks, *block.shape[2:])


def chunks_first(value: jax.Array, heads: int) -> jax.Array:
    """`[H*n, ...]` back to a per-chunk block `[n, H, ...]`."""
    chunks = value.shape[0] // heads
    return jnp.swapaxes(value.reshape(heads, chunks, *value.shape[1:]), 0, 1)


def token_call(kernel, geo: TokenGeometry, inputs, in_specs, out_shape, out_specs, *, cost, name: str):
    """Runs a token-major kernel over the grid (batch rows "parallel", time steps "arbitrary") with a
    float32 VMEM scratch `[H, V, K]` (the states, or their gradients, of all heads), allowed
    `KERNEL_VMEM_BUDGET_BYTES` of scoped VMEM (all heads' blocks and temporaries of n chunks)."""
    with jax.named_scope(name):
        return pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=geo.grid(inputs[0].shape[0]),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((geo.num_heads, geo.value_dim, geo.key_dim), jnp.float32)],
            compiler_params=compiler_params("parallel", "arbitrary", vmem_limit_bytes=KERNEL_VMEM_BUDGET_BYTES),
            interpret=interpret_params(geo.interpret),
            cost_estimate=cost,
            name=name,
        )(*inputs)
