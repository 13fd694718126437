"""Where the tokens and states of a decode call go: the token grid and the pool slots.

The decode kernels work on a grid of N sequences by S_pad token positions: `[N, S_pad, heads, X]`
(tiny tensors: a few tokens per sequence). `TokenGrid` moves the call's
tokens between their layout (`[B, T, heads, X]`, or packed `[1, T, heads, X]` with `cu_seqlens`)
and the grid; gathers happen here, in XLA, never in kernels. `PoolSlots` says which pool slot
every sequence reads and which slots its states are written to (`gla_core.state_args` has the
semantics).

S, the most tokens of a sequence, is static: T without `cu_seqlens`, the width of 2-D
`ssm_state_indices [N, S]`, or the longest packed sequence known on the host (`cu_seqlens_cpu`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gla_core.tpu import NUM_SUBLANES, round_up

# Tokens of one grid step of the Pallas kernel when a sequence has more than this many.
TOKEN_BLOCK = NUM_SUBLANES


def padded_tokens(max_tokens: int) -> tuple[int, int]:
    """(S_pad, token block) for S = `max_tokens`: S itself when S <= 8 (one block), else a multiple of 8."""
    if max_tokens <= TOKEN_BLOCK:
        return max_tokens, max_tokens
    return round_up(max_tokens, TOKEN_BLOCK), TOKEN_BLOCK


def max_tokens_of(batch: int, seq_len: int, ssm_state_indices, host_boundaries) -> int:
    """S: the static bound on the tokens of one sequence (see the module doc); at least 1."""
    if ssm_state_indices.ndim == 2:
        return int(ssm_state_indices.shape[1])
    if host_boundaries is None:
        return max(1, seq_len)
    return max(1, int(np.max(np.diff(np.asarray(host_boundaries)))))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenGrid:
    """The call's tokens on the `[N, S_pad]` grid.

    Static: batch (B), seq_len (T), max_tokens (S), padded (S_pad), block (tokens per kernel step),
    packed (the call has `cu_seqlens`).
    Arrays: lengths [N] int32 tokens of each sequence; source [N, S_pad] int32 token index in the
    packed row (packed calls); token_sequence, token_position [T] int32 grid cell of each packed token.
    """

    batch: int = dataclasses.field(metadata=dict(static=True))
    seq_len: int = dataclasses.field(metadata=dict(static=True))
    max_tokens: int = dataclasses.field(metadata=dict(static=True))
    padded: int = dataclasses.field(metadata=dict(static=True))
    block: int = dataclasses.field(metadata=dict(static=True))
    packed: bool = dataclasses.field(metadata=dict(static=True))
    lengths: jax.Array
    source: jax.Array | None
    token_sequence: jax.Array | None
    token_position: jax.Array | None

    @classmethod
    def build(cls, batch: int, seq_len: int, max_tokens: int, cu_seqlens=None) -> TokenGrid:
        padded, block = padded_tokens(max_tokens)
        if cu_seqlens is None:
            lengths = jnp.full((batch,), min(seq_len, max_tokens), jnp.int32)
            return cls(batch, seq_len, max_tokens, padded, block, False, lengths, None, None, None)
        cu = cu_seqlens.astype(jnp.int32)
        lengths = cu[1:] - cu[:-1]
        steps = jnp.arange(padded, dtype=jnp.int32)
        source = jnp.clip(cu[:-1, None] + steps[None, :], 0, max(seq_len - 1, 0))
        tokens = jnp.arange(seq_len, dtype=jnp.int32)
        sequence = jnp.clip(jnp.searchsorted(cu[1:], tokens, side="right"), 0, cu.shape[0] - 2).astype(jnp.int32)
        return cls(batch, seq_len, max_tokens, padded, block, True, lengths, source, sequence, tokens - cu[sequence])

    @property
    def num_sequences(self) -> int:
        return self.lengths.shape[0]

    def valid(self) -> jax.Array:
        """[N, S_pad] bool: the grid cell holds a token."""
        return jnp.arange(self.padded, dtype=jnp.int32)[None, :] < self.lengths[:, None]

    def to_grid(self, x: jax.Array) -> jax.Array:
        """[B, T, heads, X] (packed: B = 1) -> [N, S_pad, heads, X], zeros in empty cells."""
        if not self.packed:
            x = x[:, : self.max_tokens]
            return jnp.pad(x, ((0, 0), (0, self.padded - x.shape[1]), (0, 0), (0, 0)))
        if self.seq_len == 0:
            return jnp.zeros((self.num_sequences, self.padded, *x.shape[2:]), x.dtype)
        return jnp.where(self.valid()[..., None, None], x[0][self.source], jnp.zeros((), x.dtype))

    def from_grid(self, y: jax.Array, fill=jnp.nan) -> jax.Array:
        """[N, S_pad, heads, ...] -> [B, T, heads, ...]; a token past S (a 2-D pool call with too many
        tokens in a sequence) gets `fill`."""
        if not self.packed:
            y = y[:, : self.seq_len]
            if self.seq_len > self.max_tokens:
                extra = jnp.full((y.shape[0], self.seq_len - self.max_tokens, *y.shape[2:]), fill, y.dtype)
                y = jnp.concatenate([y, extra], axis=1)
            return y
        position = jnp.minimum(self.token_position, self.padded - 1)
        out = y[self.token_sequence, position]  # [T, heads, ...]
        past = (self.token_position >= self.max_tokens).reshape((-1,) + (1,) * (out.ndim - 1))
        return jnp.where(past, jnp.asarray(fill, out.dtype), out)[None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PoolSlots:
    """Pool slots of every sequence (int32).

    read: [N] slot whose state a sequence starts from, clamped into [0, P) (read_ok says if it is real).
    read_ok: [N] 1 where the read slot is a real slot (0 <= slot < P), else 0 (a zero state).
    write: [N, W] slots written: W = S_pad (the state after each token; 2-D indices) or 1 (after the
      last token; 1-D indices); -1 where nothing is written (padding slot, no token there).
    per_token: W = S_pad (static).
    """

    read: jax.Array
    read_ok: jax.Array
    write: jax.Array
    per_token: bool = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def build(cls, ssm_state_indices, num_accepted_tokens, pool_size: int, grid: TokenGrid) -> PoolSlots:
        idx = ssm_state_indices.astype(jnp.int32)
        real = lambda slot: (slot >= 0) & (slot < pool_size)
        if idx.ndim == 1:
            read = idx
            write = jnp.where(real(idx) & (grid.lengths > 0), idx, -1)[:, None]
        else:
            rows = jnp.arange(idx.shape[0])
            accepted = jnp.ones_like(grid.lengths) if num_accepted_tokens is None else num_accepted_tokens
            read = idx[rows, jnp.clip(accepted.astype(jnp.int32) - 1, 0, idx.shape[1] - 1)]
            padded = jnp.pad(idx, ((0, 0), (0, grid.padded - idx.shape[1])), constant_values=-1)
            write = jnp.where(real(padded) & grid.valid(), padded, -1)
        ok = real(read)
        return cls(jnp.where(ok, read, 0), ok.astype(jnp.int32), write, idx.ndim == 2)
