"""Test problems of the decode path with a state pool: prepared inputs, a pool, slots, the oracle.

The shared decode step (`gla_core.kit.decode.decode_attention`) takes prepared inputs (q scaled,
the log decay, beta); its float64 oracle is `gla_ref.decode` on the same inputs (simple_gla for a
scalar gate, gla for a per-key one, kda's delta rule with beta), so the scale is 1 and q is
already scaled in a `DecodeProblem`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gla_ref import decode as reference


@dataclasses.dataclass(frozen=True)
class DecodeProblem:
    """One decode call: prepared inputs in the call's layout and the pool arguments."""

    op: str  # the oracle's op: "simple_gla" (scalar gate), "gla" (per-key gate), "kda" (delta rule)
    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array  # [B, T, HV, 1] or [B, T, HV, K]
    beta: jax.Array | None
    pool: jax.Array
    ssm_state_indices: jax.Array
    num_accepted_tokens: jax.Array | None = None
    cu_seqlens: jax.Array | None = None
    host_boundaries: tuple[int, ...] | None = None
    v_first: bool = False
    inplace_final_state: bool = True

    def arguments(self) -> dict:
        """Keyword arguments of `gla_core.decode.decode_attention` (without `pallas` / `interpret`)."""
        return dict(
            pool=self.pool,
            ssm_state_indices=self.ssm_state_indices,
            num_accepted_tokens=self.num_accepted_tokens,
            cu_seqlens=self.cu_seqlens,
            host_boundaries=self.host_boundaries,
            v_first=self.v_first,
            inplace_final_state=self.inplace_final_state,
        )

    def oracle(self):
        """(o, pool or per-token states) in float64 from `gla_ref.decode`."""
        arrays = dict(
            q=self.q,
            k=self.k,
            v=self.v,
            initial_state=self.pool,
            ssm_state_indices=self.ssm_state_indices,
            num_accepted_tokens=self.num_accepted_tokens,
            cu_seqlens=self.cu_seqlens,
        )
        if self.op == "simple_gla":
            arrays["g"] = self.g[..., 0]
        elif self.op == "gla":
            arrays["gk"] = self.g
        else:
            arrays.update(g=self.g, beta=self.beta)
        options = dict(scale=1.0, state_v_first=self.v_first, inplace_final_state=self.inplace_final_state)
        return reference.float64_oracle(self.op, arrays, **options)


def decode_problem(
    op: str,
    *,
    lengths=(1, 1, 1),
    packed: bool = False,
    heads: int = 2,
    value_heads: int | None = None,
    key_dim: int = 16,
    value_dim: int = 24,
    slots: int = 9,
    indices=None,
    accepted=None,
    v_first: bool = False,
    pool_dtype=jnp.float32,
    inplace_final_state: bool = True,
    seed: int = 0,
) -> DecodeProblem:
    """A decode problem: sequences of `lengths` tokens (packed with `cu_seqlens`, or a batch of equal
    lengths), random inputs (unit-norm keys, decays in about [-1, 0]), a random pool of `slots` states.

    indices: `ssm_state_indices` (default: 1-D, every sequence its own slot from the end of the pool).
    """
    rng = np.random.default_rng(seed)
    value_heads = heads if value_heads is None else value_heads
    lengths = list(lengths)
    if packed:
        batch, seq_len = 1, sum(lengths)
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    else:
        batch, seq_len = len(lengths), lengths[0]
        cu = None
    normal = lambda *shape: rng.standard_normal(shape)
    k = normal(batch, seq_len, heads, key_dim)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    gate_width = 1 if op == "simple_gla" else key_dim
    g = -np.abs(rng.normal(0.3, 0.3, size=(batch, seq_len, value_heads, gate_width)))
    state_shape = (value_dim, key_dim) if v_first else (key_dim, value_dim)
    if indices is None:
        indices = slots - 1 - np.arange(len(lengths))
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return DecodeProblem(
        op=op,
        q=f32(normal(batch, seq_len, heads, key_dim) * key_dim**-0.5),
        k=f32(k),
        v=f32(normal(batch, seq_len, value_heads, value_dim)),
        g=f32(g),
        beta=f32(1 / (1 + np.exp(-normal(batch, seq_len, value_heads)))) if op == "kda" else None,
        pool=jnp.asarray(normal(slots, value_heads, *state_shape), pool_dtype),
        ssm_state_indices=jnp.asarray(indices, jnp.int32),
        num_accepted_tokens=None if accepted is None else jnp.asarray(accepted, jnp.int32),
        cu_seqlens=None if cu is None else jnp.asarray(cu),
        host_boundaries=None if cu is None else tuple(int(c) for c in cu),
        v_first=v_first,
        inplace_final_state=inplace_final_state,
    )


def written_slots(problem: DecodeProblem) -> set[int]:
    """The pool slots the call writes (see `gla_core.state_args`)."""
    idx = np.asarray(problem.ssm_state_indices)
    slots = problem.pool.shape[0]
    if problem.cu_seqlens is None:
        lengths = np.full(idx.shape[0], problem.q.shape[1])
    else:
        lengths = np.diff(np.asarray(problem.cu_seqlens))
    if idx.ndim == 1:
        return {int(s) for s, n in zip(idx, lengths, strict=True) if 0 <= s < slots and n > 0}
    return {int(idx[i, t]) for i in range(idx.shape[0]) for t in range(lengths[i]) if 0 <= idx[i, t] < slots}
