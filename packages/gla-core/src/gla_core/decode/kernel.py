"""The Pallas TPU decode kernel: a few tokens of many sequences, states read from and written to a pool.

Grid (N sequences, HV / hb head blocks, S_pad / ts token blocks). Per grid step, for every head of
the block and every token of the block (per head, state S float32):

    S <- exp(g_t) S      (a scalar, or one factor per key)
    S <- S + k_t w_t^T   with w_t = v_t, or the delta rule's w_t = beta_t (v_t - S^T k_t)
    o_t = q_t^T S        (q already scaled)

The state tile is the pool's layout: `[K, V]` (FLA's default) or `[V, K]` (`state_v_first`). A
token's vectors arrive as rows `[hb, X]` for all heads of the block; the vectors that must broadcast
along the state's lanes (q, k and a per-key gate for `[K, V]`; v for `[V, K]`) are transposed once
per token to `[X, hb]` and head h reads its column h. The products with S are exact float32 sums
(over sublanes for `[K, V]`, lanes for `[V, K]`): elementwise VPU work, since with one token per
head a matmul would use one row of the MXU. Cells past a sequence's length hold zeros (decay 1,
k = 0): they leave the state unchanged and nothing of them is written out.

Memory: the pool `[P, HV, R, L]` stays in HBM. The block of slot `read[n]` is read through the
BlockSpec pipeline (a scalar-prefetched index map, so the next sequence's state is fetched while
this one computes); the states go back by DMA into the same buffer (`input_output_aliases`), only
to the slots that are written, so every other slot keeps its bytes. The heads of a block are worked
in `HEAD_GROUPS` groups, and a group's states leave as soon as its heads are done, overlapping the
next group's compute; the step waits for all of them at its end (no DMA outlives its grid step, so
the grid dimensions stay parallel). Per-sequence writes (1-D indices) go after the sequence's last
token block, straight from the float32 state (or a copy in the pool's dtype); per-token writes
(2-D indices) from one buffer per token of the block. With `token_states`
(inplace_final_state=False) the state after every token is an ordinary output block instead and
the pool is not written.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_core.chunk.common import compiler_params, cost_estimate
from gla_core.decode.layout import PoolSlots, TokenGrid
from gla_core.decode.tokens import DecodeTokens
from gla_core.tpu import NUM_SUBLANES, interpret_params, pad_axis, round_up

# VMEM the kernel's blocks and scratch may use (double-buffered pool blocks, state, write buffers):
# well inside v5e's default scoped limit of 16 MiB.
VMEM_BUDGET_BYTES = 8 * 2**20


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static facts of one decode kernel launch.

    Attributes:
      scalar_gate: the gate is one value per head and token (else one per key).
      delta_rule: kda's delta rule (beta given).
      v_first: the pool's states are [V, K] (else [K, V]).
      per_token: the state after every token goes to its own slot (2-D indices).
      token_states: return the state after every token instead of writing the pool.
      head_block: hb, heads per grid step; token_block: ts, tokens per grid step.
      head_groups: the head block is worked in this many groups, each group's states written as soon
        as it is done (a divisor of hb).
      interpret: TPU interpret mode.
    """

    scalar_gate: bool
    delta_rule: bool
    v_first: bool
    per_token: bool
    token_states: bool
    head_block: int
    token_block: int
    head_groups: int
    interpret: bool


def head_block(heads: int, state_elements: int, pool_itemsize: int, buffers: int) -> int:
    """The head block hb: all `heads`, or a divisor of it that is a multiple of 8, the largest whose VMEM
    use fits `VMEM_BUDGET_BYTES` (the token blocks' second-minor dimension is the heads).

    Per head: the float32 state, two pool blocks (double buffering) and `buffers` more states (write
    buffers or token-state output blocks; counted as float32).
    """
    per_head = state_elements * (4 + 2 * pool_itemsize + 4 * buffers)
    candidates = [hb for hb in range(NUM_SUBLANES, heads, NUM_SUBLANES) if heads % hb == 0] + [heads]
    fitting = [hb for hb in candidates if hb * per_head <= VMEM_BUDGET_BYTES]
    return max(fitting, default=min(candidates))


HEAD_GROUPS = 4  # at most; the writes of all but the last group overlap compute


def head_groups(head_block: int) -> int:
    """The number of head groups of a head block: `HEAD_GROUPS`, or fewer when it does not divide."""
    return max(g for g in range(1, HEAD_GROUPS + 1) if head_block % g == 0)


def to_key_rows(state, config: DecodeConfig):
    """A state tile between the kernel's [K, V] and a [V, K] pool (transposed when `v_first`; its own inverse)."""
    return state.T if config.v_first else state


def _transposed(x):
    """[hbp, X] -> [X, hbp]: head h's vector becomes column h."""
    return x.T


def _decode_kernel(read_ref, read_ok_ref, write_ref, *refs, config: DecodeConfig, writes: int):
    num_inputs = 6 if config.delta_rule else 5
    q_ref, k_ref, _, g_ref = refs[:4]  # [1, ts, hbp, K|K|V|1 or K]; beta [1, ts, hbp, 1] with the delta rule
    pool_ref = refs[num_inputs - 1]  # [1, hb, R, L]: the block of the read slot
    out_ref = refs[num_inputs + 1]  # the pool (HBM) or the token states; refs[num_inputs] is o [1, ts, hbp, V]
    state_ref, columns_ref = refs[num_inputs + 2 : num_inputs + 4]  # [hb, K, V] f32; [ts, 3, K, hbp] f32
    write_refs = refs[num_inputs + 4 :]  # buffer [W, hb, R, L] (pool dtype) or none; DMA semaphores
    n, head_block_index, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hb, ts = config.head_block, config.token_block

    @pl.when(t == 0)
    def _start():
        ok = read_ok_ref[n] == 1
        for h in range(hb):  # the state is kept [K, V]: a [V, K] pool's state is transposed once
            state_ref[h] = jnp.where(ok, to_key_rows(pool_ref[0, h].astype(jnp.float32), config), 0.0)

    def transpose_token(s, _):
        columns_ref[s, 0] = _transposed(q_ref[0, s].astype(jnp.float32))
        columns_ref[s, 1] = _transposed(k_ref[0, s].astype(jnp.float32))
        if not config.scalar_gate:
            columns_ref[s, 2] = _transposed(jnp.exp(g_ref[0, s].astype(jnp.float32)))
        return 0

    jax.lax.fori_loop(0, ts, transpose_token, 0)
    writer = None if config.token_states else _Writer(out_ref, state_ref, write_refs, write_ref, config, writes)
    group = hb // config.head_groups
    for first_head in range(0, hb, group):
        heads = range(first_head, first_head + group)
        jax.lax.fori_loop(0, ts, functools.partial(_token, refs=refs, heads=heads, config=config), 0)
        if writer is not None:
            writer.start(n, head_block_index, t, heads)
    if writer is not None:
        writer.wait(n, t)


def _token(s, carry, *, refs, heads, config: DecodeConfig):
    """Token s of the block for `heads`; the states stay in the state scratch."""
    num_inputs = 6 if config.delta_rule else 5
    v_ref, g_ref = refs[2:4]  # q and k are read transposed, from the columns scratch
    beta_ref = refs[4] if config.delta_rule else None
    o_ref, out_ref = refs[num_inputs : num_inputs + 2]
    state_ref, columns_ref = refs[num_inputs + 2 : num_inputs + 4]
    buffer_ref = refs[num_inputs + 4] if config.per_token and not config.token_states else None
    row = lambda ref, h: ref[0, s, pl.ds(h, 1), :].astype(jnp.float32)  # [1, X]
    column = lambda i, h: columns_ref[s, i, :, pl.ds(h, 1)]  # [X, 1]
    for h in heads:
        state = state_ref[h]  # [K, V]
        state = state * (jnp.exp(row(g_ref, h)) if config.scalar_gate else column(2, h))
        k, w = column(1, h), row(v_ref, h)  # [K, 1], [1, V]
        if config.delta_rule:
            w = row(beta_ref, h) * (w - jnp.sum(state * k, axis=0, keepdims=True))
        state = state + k * w
        o_ref[0, s, pl.ds(h, 1), :] = jnp.sum(state * column(0, h), axis=0, keepdims=True).astype(o_ref.dtype)
        state_ref[h] = state
        if config.token_states:
            out_ref[0, s, h] = to_key_rows(state, config).astype(out_ref.dtype)
        elif buffer_ref is not None:
            buffer_ref[s, h] = to_key_rows(state, config).astype(buffer_ref.dtype)
    return carry


class _Writer:
    """The DMAs of one grid step's states to their pool slots (a slot < 0 is skipped).

    `start` sends a head group's states as soon as the group is done; `wait` waits for every DMA
    the step started, with the same conditions.
    """

    def __init__(self, pool_ref, state_ref, write_refs, write_ref, config: DecodeConfig, writes: int):
        self.pool_ref, self.state_ref, self.config = pool_ref, state_ref, config
        *buffer, self.semaphores = write_refs  # semaphores [groups, W]
        self.buffer = buffer[0] if buffer else None  # [W, hb, R, L] in the pool's dtype
        self.write_ref, self.writes = write_ref, writes
        self.started = []  # (condition, copy) of every DMA of the step

    def _slots(self, n, t):
        """(condition to write, slot) of every state the step may write."""
        config = self.config
        if config.per_token:
            ts = config.token_block
            return [(True, self.write_ref[n * self.writes + t * ts + i]) for i in range(ts)]
        return [(t == pl.num_programs(2) - 1, self.write_ref[n])]  # after the sequence's last token block

    def start(self, n, head_block_index, t, heads):
        config = self.config
        group_index = heads[0] // len(heads)
        local = pl.ds(heads[0], len(heads))
        target_heads = pl.ds(head_block_index * config.head_block + heads[0], len(heads))
        for i, (ready, slot) in enumerate(self._slots(n, t)):
            if config.per_token:
                source = self.buffer.at[i, local]
            elif self.buffer is not None:  # a [V, K] pool, or another dtype than the float32 state
                source = self.buffer.at[0, local]

                @pl.when(ready & (slot >= 0))
                def _copy():
                    for h in heads:
                        self.buffer[0, h] = to_key_rows(self.state_ref[h], config).astype(self.buffer.dtype)

            else:
                source = self.state_ref.at[local]
            target = self.pool_ref.at[jnp.maximum(slot, 0), target_heads]
            copy = pltpu.make_async_copy(source, target, self.semaphores.at[group_index, i])
            condition = ready & (slot >= 0)
            pl.when(condition)(copy.start)
            self.started.append((condition, copy))

    def wait(self, n, t):
        for condition, copy in self.started:
            pl.when(condition)(copy.wait)


def decode_pallas(tokens: DecodeTokens, pool, slots: PoolSlots, grid: TokenGrid, config: DecodeConfig):
    """The decode step on the Pallas kernel (see the module doc).

    Args:
      tokens: prepared tokens `[N, S_pad, HV, X]` float32.
      pool: `[P, HV, R, L]` states (R, L = K, V, or V, K with `v_first`), any float dtype.
      slots, grid: the pool slots and the token grid.
      config: the launch's static facts.

    Returns:
      (o [N, S_pad, HV, V] float32, the updated pool — or with `token_states` the state after every
      grid cell [N, S_pad, HV, R, L] float32).
    """
    num_sequences, padded, heads, _ = tokens.q.shape
    value_dim = tokens.v.shape[-1]
    _, _, rows, lanes = pool.shape
    hb, ts = config.head_block, config.token_block
    # The token blocks' second-minor dimension is the heads: a multiple of 8, or all of them padded to one.
    hbp = round_up(hb, NUM_SUBLANES)
    pad_heads = lambda x: pad_axis(x, 2, round_up(heads, NUM_SUBLANES)) if hbp != hb else x
    inputs = [pad_heads(x) for x in (tokens.q, tokens.k, tokens.v, tokens.g)]
    inputs += [pad_heads(tokens.beta)] if config.delta_rule else []
    token_spec = lambda width: pl.BlockSpec((1, ts, hbp, width), lambda n, h, t, *_: (n, t, h, 0))
    in_specs = [token_spec(x.shape[-1]) for x in inputs]
    in_specs.append(pl.BlockSpec((1, hb, rows, lanes), lambda n, h, t, read, *_: (read[n], h, 0, 0)))
    o_shape = jax.ShapeDtypeStruct((num_sequences, padded, inputs[2].shape[2], value_dim), jnp.float32)
    key_dim = inputs[0].shape[-1]
    columns = pltpu.VMEM((ts, 3, key_dim, hbp), jnp.float32)  # q, k, exp(g) of every token, transposed
    scratch = [pltpu.VMEM((hb, key_dim, value_dim), jnp.float32), columns]
    if config.token_states:
        states = jax.ShapeDtypeStruct((num_sequences, padded, heads, rows, lanes), jnp.float32)
        out_shape = [o_shape, states]
        out_specs = [token_spec(value_dim), pl.BlockSpec((1, ts, hb, rows, lanes), lambda n, h, t, *_: (n, t, h, 0, 0))]
        aliases = {}
    else:
        out_shape = [o_shape, jax.ShapeDtypeStruct(pool.shape, pool.dtype)]
        out_specs = [token_spec(value_dim), pl.BlockSpec(memory_space=pl.ANY)]
        aliases = {3 + len(inputs): 1}  # the pool (after the 3 scalar-prefetch operands and the tokens)
        width = ts if config.per_token else 1
        if config.per_token or config.v_first or pool.dtype != jnp.float32:
            scratch.append(pltpu.VMEM((width, hb, rows, lanes), pool.dtype))
        scratch.append(pltpu.SemaphoreType.DMA((config.head_groups, width)))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(num_sequences, heads // hb, padded // ts),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=scratch,
    )
    kernel = functools.partial(_decode_kernel, config=config, writes=slots.write.shape[1])
    with jax.named_scope("gla_decode"):
        o, out = pl.pallas_call(
            kernel,
            grid_spec=grid_spec,
            out_shape=out_shape,
            input_output_aliases=aliases,
            compiler_params=compiler_params("parallel", "parallel", "arbitrary"),
            cost_estimate=_cost(inputs, o_shape, pool, slots, config),
            interpret=interpret_params(config.interpret),
        )(slots.read, slots.read_ok, slots.write.reshape(-1), *inputs, pool)
    return o[:, :, :heads], out


def _cost(inputs, o_shape, pool, slots, config: DecodeConfig) -> pl.CostEstimate:
    """Flops and exps of every grid cell's state update; bytes of the tokens, o, the states read and
    the states written (or the token states)."""
    num_sequences, padded = inputs[0].shape[:2]
    _, heads, rows, lanes = pool.shape
    cells = num_sequences * padded * heads
    state = rows * lanes * jnp.dtype(pool.dtype).itemsize
    written = cells if (config.per_token or config.token_states) else num_sequences * heads
    estimate = cost_estimate(
        flops=cells * rows * lanes * (8 if config.delta_rule else 6),
        transcendentals=cells * (1 if config.scalar_gate else inputs[0].shape[-1]),
        arrays=[*inputs, o_shape],
    )
    return pl.CostEstimate(
        flops=estimate.flops,
        transcendentals=estimate.transcendentals,
        bytes_accessed=estimate.bytes_accessed + (num_sequences * heads + written) * state,
    )
