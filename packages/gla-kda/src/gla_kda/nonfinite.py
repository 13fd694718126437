"""Non-finite inputs reach exactly the outputs the recurrence lets them reach, in the `xla` chunked form.

The chunked forms mix the steps of a chunk in matmuls: a triangular matrix
times a tensor with a NaN in a later row gives 0 * NaN = NaN in the earlier rows too, so a NaN
or Inf at step t would reach outputs before t. Instead, the non-finite inputs are replaced by
zeros before the chunked computation (`NonFiniteGuard.build`), and afterwards the outputs the
token-by-token recurrence would make non-finite are set to NaN (`NonFiniteGuard.apply`). The Pallas
`chunk` kernels apply the same rules inside (`gla_kda.pallas.poison`), without passes over the
inputs and outputs in XLA.

Which outputs those are follows from the recurrence (per sequence and value head, S [K, V]):
    S <- diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = q_t^T S
  - a non-finite k_t, g_t (NaN or +inf; -inf is a hard reset, see `inputs.floor_log_decay`) or
    beta_t reaches every column of S from step t on: o_u for u >= t and the final state;
  - a non-finite v_t[c] only reaches column c of S (the columns evolve independently);
  - a non-finite column c of the initial state reaches column c from the sequence's first step;
  - a non-finite q_t only reaches o_t.
Nothing crosses into another sequence, batch row or value head (q/k heads reach the value heads
that read them).

Poisoned outputs are multiplied by NaN (not overwritten), so the backward carries NaN into the
gradients of the poisoned sequence and head as the recurrence's own backward would, and the
replaced inputs pass their cotangent through unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gla_core.kit import any_nonfinite
from gla_kda.inputs import expand_value_heads

_NO_STEP = jnp.iinfo(jnp.int32).max


@jax.custom_jvp
def zero_nonfinite(x):
    """x with NaN and +-inf entries replaced by 0; the gradient passes through unchanged."""
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


@zero_nonfinite.defjvp
def _zero_nonfinite_jvp(primals, tangents):
    (x,), (tangent,) = primals, tangents
    return zero_nonfinite(x), tangent


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NonFiniteGuard:
    """Where the recurrence would produce non-finite outputs from non-finite inputs.

    output: [B, T, HV, V] bool, o[b, t, j, c] is non-finite.
    final: [N, HV, 1, V] bool, column c of sequence n's final state is non-finite.
    """

    output: jax.Array
    final: jax.Array

    @classmethod
    def build(cls, q, k, v, g, beta, initial_state=None, cu_seqlens=None):
        """The guard of one call, and its inputs with every non-finite entry replaced by 0.

        Args:
          q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K] log decay (floored);
          beta: [B, T, HV]; initial_state: [N, HV, K, V] or None; cu_seqlens: [N+1] int32 or None.

        Returns:
          (guard, (q, k, v, g, beta, initial_state)) with the inputs made finite.
        """
        _, seq_len, heads, _ = v.shape
        steps = jnp.arange(seq_len, dtype=jnp.int32)[None, :, None, None]  # [1, T, 1, 1]
        whole_state = (
            expand_value_heads(any_nonfinite(k)[..., None], heads)[..., 0] | any_nonfinite(g) | ~jnp.isfinite(beta)
        )  # [B, T, HV]
        # The first step that reaches column c of the state: the earlier of the first step that reaches
        # the whole state and the first non-finite v[..., c], each found on its own array (a [B, T, HV]
        # flag broadcast over the value lanes would be relaid out first).
        first_whole = jnp.where(whole_state, steps[..., 0], _NO_STEP)  # [B, T, HV]
        first_column = jnp.where(jnp.isfinite(v), _NO_STEP, steps)  # [B, T, HV, V]
        if cu_seqlens is None:
            sequence = None
        else:
            sequence = jnp.clip(jnp.searchsorted(cu_seqlens, steps[0, :, 0, 0], side="right") - 1, 0)  # [T]

        def per_sequence_min(x):
            """[B, T, ...] -> [N, ...]: the minimum over each sequence's steps."""
            if sequence is None:
                return jnp.min(x, axis=1)
            return jax.ops.segment_min(x[0], sequence, num_segments=cu_seqlens.shape[0] - 1)

        first_bad = jnp.minimum(per_sequence_min(first_column), per_sequence_min(first_whole)[..., None])  # [N, HV, V]

        def per_step(x):
            """[N, ...] per sequence -> [B, T or 1, ...] per step."""
            return x[:, None] if sequence is None else x[sequence][None]

        if initial_state is not None:  # a non-finite initial column reaches it from the sequence's first step
            first_bad = jnp.where(any_nonfinite(initial_state, axis=2), 0, first_bad)  # [N, HV, V]
        state = steps >= per_step(first_bad)  # [B, T, HV, V]
        bad_query = expand_value_heads(any_nonfinite(q)[..., None], heads)  # [B, T, HV, 1]
        guard = cls(output=state | bad_query, final=(first_bad < _NO_STEP)[:, :, None, :])
        clean = (q, k, v, g, beta, initial_state)
        return guard, tuple(None if x is None else zero_nonfinite(x) for x in clean)

    def apply(self, o, final_state=None):
        """NaN where the recurrence is non-finite: o [B, T, HV, V], final_state [N, HV, K, V] or None."""
        o = o * jnp.where(self.output, jnp.nan, 1.0).astype(o.dtype)
        if final_state is not None:
            final_state = final_state * jnp.where(self.final, jnp.nan, 1.0).astype(final_state.dtype)
        return o, final_state
