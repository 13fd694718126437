"""The kda chunk pipeline in the kernel layout, with its backward (`jax.custom_vjp`).

Forward:  intra (Tinv, Aqk) -> state (h per chunk, delta, final states) -> output (o).
Backward: state again (h; nothing but the inputs, Tinv and Aqk is kept from the forward)
          -> reverse state gradient (dS per chunk, ddelta, d initial_state)
          -> per-chunk gradients (dq, dk, dv, dbeta, dG).
Gradients of q/k are summed over the value heads that share them. The kernels differentiate
with respect to the within-chunk cumsum G; the backward maps that to the sub-block-local
cumsum the kernels read. That cumsum, the layout changes and the gate/l2norm prologue stay
outside, in XLA, where autodiff differentiates them (a cumsum's transpose is a reverse cumsum).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from gla_kda.pallas.config import KernelConfig
from gla_kda.pallas.intra import launch_intra
from gla_kda.pallas.intra_bwd import launch_intra_bwd
from gla_kda.pallas.layout import ChunkMeta, chunk_grad_to_local
from gla_kda.pallas.output import launch_output
from gla_kda.pallas.state import StateOutputs, launch_state
from gla_kda.pallas.state_bwd import launch_state_bwd


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Static facts of one pipeline run.

    Attributes:
      kernel: the kernels' configuration.
      has_initial_state: an initial state is given.
      output_final_state: return the final state of every sequence.
      num_states: N, the number of sequences (batch rows, or packed sequences).
    """

    kernel: KernelConfig
    has_initial_state: bool
    output_final_state: bool
    num_states: int


def _mask_empty(states, empty):
    """Zeros where the sequence is empty (kernels never write those state blocks)."""
    return jnp.where(empty[:, None, None, None] == 1, 0.0, states)


def _forward(config: PipelineConfig, q, k, v, g, beta, h0, meta: ChunkMeta):
    kernel = config.kernel
    tinv, aqk = launch_intra(q, k, g, beta, kernel)
    outputs = StateOutputs(
        has_initial_state=config.has_initial_state, emit_delta=True, emit_final_state=config.output_final_state
    )
    h, delta, ht = launch_state(k, v, g, beta, tinv, h0, meta, kernel, outputs, config.num_states)
    o = launch_output(q, g, h, delta, aqk, kernel, v.dtype)
    if ht is not None:
        ht = _mask_empty(ht, meta.empty)
    return (o, ht), (tinv, aqk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunk_pipeline(config: PipelineConfig, q, k, v, g, beta, h0, meta: ChunkMeta):
    """(o [B, HV, Tp, V], final states [N, HV, K, V] float32 or None) in the kernel layout.

    Args:
      q, k: [B, H, Tp, K]; v: [B, HV, Tp, V]; g: [B, HV, Tp, K] float32 sub-block-local cumsum
      of the log decay (`layout.local_cumsum`); beta: [B, HV, NT, 1, C] float32; h0: [N, HV, K, V] float32 or None;
      meta: per-chunk metadata (not differentiated).
    """
    return _forward(config, q, k, v, g, beta, h0, meta)[0]


def _pipeline_fwd(config, q, k, v, g, beta, h0, meta):
    outputs, (tinv, aqk) = _forward(config, q, k, v, g, beta, h0, meta)
    return outputs, (q, k, v, g, beta, h0, meta, tinv, aqk)


def _group_sum(x, group: int, dtype):
    """[B, HV, Tp, K] per value head -> [B, H, Tp, K] summed over each group of value heads."""
    if group == 1:
        return x.astype(dtype)
    batch, heads, length, dim = x.shape
    return x.reshape(batch, heads // group, group, length, dim).sum(axis=2).astype(dtype)


def _pipeline_bwd(config, residuals, cotangents):
    q, k, v, g, beta, h0, meta, tinv, aqk = residuals
    do, dht = cotangents
    kernel = config.kernel
    recompute = StateOutputs(has_initial_state=config.has_initial_state, emit_delta=False, emit_final_state=False)
    h, _, _ = launch_state(k, v, g, beta, tinv, h0, meta, kernel, recompute, config.num_states)
    if dht is not None:
        dht = _mask_empty(dht.astype(jnp.float32), meta.empty)
    dstate, ddelta, dh0 = launch_state_bwd(
        q, k, g, beta, tinv, aqk, do, dht, meta, kernel, config.has_initial_state, config.num_states
    )
    dq, dk, dv, dbeta, dg = launch_intra_bwd(q, k, v, g, beta, tinv, h, dstate, ddelta, do, kernel)
    if dh0 is not None:
        dh0 = _mask_empty(dh0, meta.empty).astype(h0.dtype)
    return (
        _group_sum(dq, kernel.group, q.dtype),
        _group_sum(dk, kernel.group, k.dtype),
        dv.astype(v.dtype),
        chunk_grad_to_local(dg, kernel.blocks.chunk_size, kernel.blocks.sub_chunk),
        dbeta,
        dh0,
        None,
    )


chunk_pipeline.defvjp(_pipeline_fwd, _pipeline_bwd)
