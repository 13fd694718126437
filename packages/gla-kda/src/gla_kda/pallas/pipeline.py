"""The kda chunk pipeline, with its backward (`jax.custom_vjp`).

Forward:  intra (Tinv, Aqk) -> state (o, final states, poison rows; h only with `keep_states`):
          the state kernel writes each chunk's output as the recurrence passes it.
Backward: reverse state gradient (dS per chunk, ddelta, d initial_state)
          -> per-chunk gradients (dq, dk, dv, dbeta, dG), which run the recurrence again along
          the way (h; nothing but the inputs, Tinv and Aqk is kept from the forward), or take the
          forward's h with `keep_states` (FLA's disable_recompute).
Every kernel folds a `jax.vmap` axis into its batch axis, and differentiating the backward
again raises a clear error (`gla_core.pallas_transforms`). Gradients of q/k are summed over
the value heads that share them.
Every kernel, forward and backward, reads q, k, v, dO and the raw per-step log decays g
token-major (`layout.to_tokens`), writes its per-token results token-major, and does the input
cleaning itself: non-finite entries zeroed (`nonfinite.zero_nonfinite`), g raised to its floor
(`inputs.floor_log_decay`) and its sub-block-local cumsum (`chunk_math.Decays.of_steps`); the
backward kernel differentiates the cleaning of g (`chunk_math.clean_log_decay_grad`). What the
recurrence makes non-finite comes out NaN: the state kernel poisons o, the backward kernels dO
(`poison`), and the pipeline the final states and their cotangents.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from gla_core.kit import first_order_only
from gla_kda.pallas import poison as nf
from gla_kda.pallas.config import KernelConfig
from gla_kda.pallas.intra import launch_intra
from gla_kda.pallas.intra_bwd import launch_intra_bwd
from gla_kda.pallas.layout import ChunkMeta
from gla_kda.pallas.state import StateOutputs, launch_state
from gla_kda.pallas.state_bwd import launch_state_bwd


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Static facts of one pipeline run.

    Attributes:
      kernel: the kernels' configuration.
      has_initial_state: an initial state is given.
      output_final_state: return the final state of every sequence.
      states_per_row: sequences per batch row, N / B (1, or the packed sequences of the one
        varlen row).
      varlen: the row holds `cu_seqlens` sequences, which may end at any chunk (each is padded to
        whole chunks and the row to its static worst case: even one sequence may end before the
        row's last chunk).
      keep_states: the forward's state kernel also writes the states h, and the backward takes
        them (held from the forward to the backward: one more residual of the size of k) instead
        of running the state kernel again (FLA's disable_recompute).
    """

    kernel: KernelConfig
    has_initial_state: bool
    output_final_state: bool
    states_per_row: int
    varlen: bool
    keep_states: bool = False


def _mask_empty(states, empty):
    """Zeros where the sequence is empty (kernels never write those state blocks)."""
    return jnp.where(empty[:, None, None, None] == 1, 0.0, states)


def _poisoned_states(states, columns):
    """states [N, HV, K, V] with NaN in the columns `columns` [N, HV*V] bool."""
    n, heads, _, value_dim = states.shape
    return jnp.where(columns.reshape(n, heads, 1, value_dim), jnp.nan, states)


def _initial_columns(h0):
    """[N, HV*V] bool: the columns of the initial states h0 [N, HV, K, V] holding a non-finite
    entry (or None without h0). The kernels read h0 raw (non-finite entries as 0)."""
    if h0 is None:
        return None
    n, heads, _, value_dim = h0.shape
    return jnp.any(~jnp.isfinite(h0), axis=2).reshape(n, heads * value_dim)


def _forward(config: PipelineConfig, q, k, v, g, beta, h0, meta: ChunkMeta):
    """Outputs and what the backward keeps: (Tinv, Aqk, h or None, poison rows, final columns)."""
    kernel = config.kernel
    chunk_sequence = meta.seq if config.varlen else None
    tinv, aqk = launch_intra(q, k, g, beta, kernel)
    outputs = StateOutputs(
        has_initial_state=config.has_initial_state,
        emit_states=config.keep_states,
        emit_final_state=config.output_final_state,
        emit_output=True,
        emit_poison=True,
    )
    h, o, ht, poison_rows = launch_state(
        k, v, g, beta, tinv, h0, meta, kernel, outputs, config.states_per_row, config.varlen, q=q, aqk=aqk
    )
    final_bad = None
    if ht is not None:
        final_bad = nf.final_columns(poison_rows, kernel.blocks.chunk_size, meta.last, chunk_sequence, ht.shape[0])
        if h0 is not None:  # h0 reaches an empty sequence's final state too, which no poison row covers
            final_bad = final_bad | _initial_columns(h0)
        ht = _poisoned_states(_mask_empty(ht, meta.empty), final_bad)
    return (o, ht), (tinv, aqk, h, poison_rows, final_bad)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunk_pipeline(config: PipelineConfig, q, k, v, g, beta, h0, meta: ChunkMeta):
    """(o [B, Tp, HV*V], final states [N, HV, K, V] float32 or None) in the kernel layout, NaN
    where the token-by-token recurrence makes them non-finite (`gla_kda.pallas.poison`).

    Args:
      q, k: [B, Tp, H*K]; v: [B, Tp, HV*V] (token-major, `layout.to_tokens`; K, V multiples of
      128; may hold non-finite entries, read as 0); g: [B, Tp, HV*K] float32 per-step log
      decay, not yet floored (may be -inf or non-finite); beta: [B, HV, NT, 1, C] float32 and
      h0: [N, HV, K, V] float32 or None (non-finite entries read as 0);
      meta: per-chunk metadata (not differentiated).
    """
    return _forward(config, q, k, v, g, beta, h0, meta)[0]


def _pipeline_fwd(config, q, k, v, g, beta, h0, meta):
    outputs, (tinv, aqk, h, poison_rows, final_bad) = _forward(config, q, k, v, g, beta, h0, meta)
    return outputs, (q, k, v, g, beta, h0, meta, tinv, aqk, h, poison_rows, final_bad)


def _group_sum(x, value_heads: int, group: int, dtype):
    """[B, Tp, HV*K] per value head -> [B, Tp, H*K] summed over each group of value heads."""
    if group == 1:
        return x.astype(dtype)
    batch, length, width = x.shape
    dim = width // value_heads
    grouped = x.reshape(batch, length, value_heads // group, group, dim).sum(axis=3)
    return grouped.reshape(batch, length, width // group).astype(dtype)


def _pipeline_bwd(config, residuals, cotangents):
    q, k, v, g, beta, h0, meta, tinv, aqk, h, poison_rows, final_bad = residuals
    do, dht = cotangents
    kernel = config.kernel
    if dht is not None:  # the chain rule through the poisoned final states
        dht = _poisoned_states(_mask_empty(dht.astype(jnp.float32), meta.empty), final_bad)
    value_heads = beta.shape[1]
    per_sequence = (config.has_initial_state, config.states_per_row, config.varlen)
    dstate, ddelta, dh0 = launch_state_bwd(q, k, g, beta, tinv, aqk, do, poison_rows, dht, meta, kernel, *per_sequence)
    dq, dk, dv, dbeta, dg = launch_intra_bwd(
        q, k, v, g, beta, tinv, h, dstate, ddelta, do, poison_rows, kernel, meta, h0, *per_sequence
    )
    if dh0 is not None:
        dh0 = _mask_empty(dh0, meta.empty).astype(h0.dtype)
    return (
        _group_sum(dq, value_heads, kernel.group, q.dtype),
        _group_sum(dk, value_heads, kernel.group, k.dtype),
        dv,
        dg,
        dbeta,
        dh0,
        None,
    )


chunk_pipeline.defvjp(
    first_order_only(_pipeline_fwd, implementation="chunk", op="kda", nondiff_argnums=(0,)),
    first_order_only(_pipeline_bwd, implementation="chunk", op="kda", nondiff_argnums=(0,)),
)
