"""Non-finite values in v and in the gates: compute with finite stand-ins, then mark what they reach.

In the recurrence a nan or inf in v at step t (or a nan / +inf gate) makes the state non-finite
from step t on, so every later output of its sequence is non-finite and no earlier one is. A
chunked form multiplies whole chunks of v by attention weights that are exactly 0 above the
diagonal, and 0 · inf = nan would carry the value backwards to steps before t; the gate
cumsums are matmuls against 0/1 masks with the same effect.

So the chunked core computes with the non-finite entries replaced by 0, and this module sets the
outputs the recurrence would make non-finite to nan: in value column d of head h, every step
from the first non-finite v[·, h, d] of the sequence on, and every column from the first
non-finite gate of the head on; the final state of that sequence and head likewise. (A -inf gate
is a hard reset, not a non-finite value: it was clamped at `numerics.LOG_DECAY_FLOOR` before.)

Non-finite q or k need nothing here: they enter the chunked form through products that are
selected away (`jnp.where`), not multiplied by 0.

Arrays use the chunk layout `[Bp, NT, C, H, X]` of `gla_simple.layout`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from gla_core.kit import any_nonfinite
from gla_simple.layout import Segments


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """Where the non-finite values of v and of the gates are.

    Attributes:
      bad: [Bp, NT, C, H, V] bool, step t of head h has a non-finite v in column d, or a
        non-finite gate.
    """

    bad: jax.Array

    @classmethod
    def find(cls, v: jax.Array, g: jax.Array) -> NonFinite:
        """From v [Bp, NT, C, H, V] and the clamped gates g [Bp, NT, C, H, 1|K]."""
        bad_gate = any_nonfinite(g, axis=-1, keepdims=True)
        return cls(~jnp.isfinite(v) | bad_gate)

    @staticmethod
    def finite(x: jax.Array) -> jax.Array:
        """x with every nan and inf replaced by 0."""
        return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))

    def reached(self, segments: Segments) -> jax.Array:
        """[Bp, NT, C, H, V] bool: an output the recurrence makes non-finite (a bad entry at or
        before it in the same sequence)."""
        within = jnp.cumsum(self.bad.astype(jnp.int32), axis=2) > 0  # [Bp, NT, C, H, V]
        in_chunk = jnp.any(self.bad, axis=2)  # [Bp, NT, H, V]

        def step(seen, chunk):
            in_chunk_n, first_n = chunk
            seen = jnp.where(first_n, False, seen)
            return seen | in_chunk_n, seen

        start = jnp.zeros_like(in_chunk[:, 0])
        _, before = lax.scan(step, start, (jnp.moveaxis(in_chunk, 1, 0), segments.first))
        return within | jnp.moveaxis(before, 0, 1)[:, :, None]

    def mark(self, o: jax.Array, final: jax.Array, segments: Segments) -> tuple[jax.Array, jax.Array]:
        """o [Bp, NT, C, H, V] and final [N, H, K, V] with what the bad entries reach set to nan."""
        nan = jnp.asarray(jnp.nan, o.dtype)
        o = jnp.where(self.reached(segments), nan, o)
        per_chunk = jnp.any(self.bad, axis=2)  # [Bp, NT, H, V]
        if segments.varlen:
            per_sequence = (
                jax.ops.segment_max(per_chunk[0].astype(jnp.int32), segments.sequence, num_segments=final.shape[0]) > 0
            )
        else:
            per_sequence = jnp.any(per_chunk, axis=1)  # [N = Bp, H, V]
        return o, jnp.where(per_sequence[:, :, None, :], nan, final)
