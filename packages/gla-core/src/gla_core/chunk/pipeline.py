"""The chunked gated-linear-attention op on the Pallas TPU chunk kernels, with its backward.

A call of fixed length whose sizes fit takes `token_pipeline` instead: the per-key math (a scalar
gate broadcast over the keys) on the op's own token-major arrays, no re-layout. Otherwise:

Forward:  prepare -> chunk_fwd (states in VMEM, outputs and final states; under differentiation
          also the intra-chunk scores, and for the fused backward the state before every chunk)
          -> back to [B, T, H, V].
Backward: prepare do -> a per-key gate with all of K and V in one block: chunk_bwd (one kernel
          walking time backwards, from the kept states and scores); otherwise chunk_fwd_h
          (recomputed states) -> chunk_bwd_dh -> chunk_bwd_dv (from the kept scores) and
          chunk_bwd_dqkg -> back to the op's layout (g_gamma: summed over B, T).

One `jax.custom_vjp` covers the whole op, so the re-layouts (padding, varlen gathers,
transposes) are differentiated by hand: every token has exactly one slot in the kernel
layout, so the gradient of a gather is the inverse gather.

Transformations: the forward and backward refuse to be differentiated again
(`pallas_transforms.first_order_only`: higher-order derivatives raise a clear error), every
kernel folds a `jax.vmap` axis into its batch axis (`pallas_transforms.fold_vmap`), and calls
without tokens (B = 0 or T = 0) are answered by `empty` without a kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from gla_core import varlen
from gla_core.chunk import bwd, prepare, token_pipeline
from gla_core.chunk.anchored import default_anchor_range
from gla_core.chunk.bwd_dh import chunk_bwd_dh
from gla_core.chunk.bwd_dqkg import chunk_bwd_dqkg
from gla_core.chunk.bwd_dv import chunk_bwd_dv
from gla_core.chunk.common import DEFAULT_BLOCK_SIZES, BlockSizes, mxu_dtype
from gla_core.chunk.empty import empty_attention, has_no_tokens
from gla_core.chunk.fwd import chunk_fwd
from gla_core.chunk.fwd_h import chunk_fwd_h
from gla_core.chunk.heads import TokenGeometry
from gla_core.chunk.specs import ChunkSpecs, chunks_per_step
from gla_core.ops import CHUNK_SIZES
from gla_core.pallas_transforms import first_order_only
from gla_core.tpu import NUM_LANES

IMPLEMENTATION = "chunk"
OPS = "simple_gla/gla"


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """Static facts of one call (hashable: the non-differentiable argument of the custom VJP).

    Attributes:
      geometry: the op's and the kernels' sizes.
      scale: multiplies q (applied to the float32 accumulations inside the kernels).
      output_final_state: return the final states.
      interpret: run the kernels in TPU interpret mode.
      block_sizes: kernel tile sizes.
      dtypes: dtype name of every given array argument by its op keyword ("q", "k", "v",
        "g", "g_gamma", "gk", "initial_state"), so gradients come back in the input dtypes.
      anchor_range: the largest in-chunk exponent of the anchored products of a per-key gate
        (`anchored.StepDecays`; on the token-major kernels also of a scalar gate); 0 takes the
        exact level products everywhere.
      head_major_only: take the head-major kernels even when the token-major ones fit (set by the
        VJP when the gate gradient needs float32 products, which the token-major backward cannot
        hold in VMEM for all heads at once).
      chunkwise_scalar_gate: take a scalar gate chunk by chunk ("scalar" mode) even where the step
        kernels could broadcast it over the keys ("broadcast" mode); set with `head_major_only`, as
        only the chunk-by-chunk gradient kernels multiply in float32.
    """

    geometry: prepare.Geometry
    scale: float
    output_final_state: bool
    interpret: bool
    block_sizes: BlockSizes
    dtypes: tuple[tuple[str, str], ...]
    anchor_range: float = 0.0
    head_major_only: bool = False
    chunkwise_scalar_gate: bool = False

    @classmethod
    def create(
        cls,
        q,
        v,
        *,
        chunk_size: int,
        scale: float | None = None,
        output_final_state: bool = False,
        num_sequences: int | None = None,
        interpret: bool = False,
        block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES,
        anchor_range: float | None = None,
        **arrays,
    ) -> ChunkConfig:
        """The config of a call with q [B, T, H, K], v [B, T, H, V] and the other arrays by
        keyword (k, g, g_gamma, gk, initial_state; None when absent). `anchor_range` None takes
        the default of the compute dtype (`anchored.default_anchor_range`)."""
        if chunk_size not in CHUNK_SIZES:
            raise ValueError(f"chunk_size: expected one of {CHUNK_SIZES}, got {chunk_size}")
        arrays = dict(q=q, v=v, **arrays)
        config = cls(
            geometry=prepare.geometry(q, v, chunk_size, num_sequences, block_sizes.block_chunks),
            scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
            output_final_state=bool(output_final_state),
            interpret=bool(interpret),
            block_sizes=block_sizes,
            dtypes=tuple(sorted((name, jnp.dtype(x.dtype).name) for name, x in arrays.items() if x is not None)),
        )
        if anchor_range is None:
            anchor_range = default_anchor_range(mxu_dtype(config.compute_dtype))
        return dataclasses.replace(config, anchor_range=float(anchor_range))

    @property
    def gate_mode(self) -> str:
        """The head-major kernels' gate mode (`ChunkSpecs.gate_mode`): "key" for gk; a scalar gate is
        "broadcast" over the keys in the step kernels when one V tile lets the fused backward
        (`bwd.chunk_bwd`) serve it and a grid step's steps fill whole 128-lane rows, else "scalar"
        (chunk by chunk)."""
        if self.has("gk"):
            return "key"
        geo = self.geometry
        one_value_tile = self.block_sizes.value_tile(geo.padded_value_dim) == geo.padded_value_dim
        whole_rows = self.step_len % NUM_LANES == 0
        return "broadcast" if one_value_tile and whole_rows and not self.chunkwise_scalar_gate else "scalar"

    @property
    def step_len(self) -> int:
        """Steps of one grid step of the sequential kernels, n*C (`sequential_specs`)."""
        geo = self.geometry
        return chunks_per_step(geo.num_chunks, self.block_sizes.block_chunks) * geo.chunk

    def has(self, name: str) -> bool:
        return name in dict(self.dtypes)

    def dtype_of(self, name: str) -> jnp.dtype:
        return jnp.dtype(dict(self.dtypes)[name])

    @property
    def compute_dtype(self) -> jnp.dtype:
        """Kernel input dtype: bfloat16 and float32 stay, other float dtypes compute in float32."""
        dtype = self.dtype_of("q")
        return dtype if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)) else jnp.dtype(jnp.float32)

    def specs(self) -> ChunkSpecs:
        """Specs of the state, output and dv kernels: V tiled, all of K."""
        geo = self.geometry
        return ChunkSpecs.value_tiled(
            self.gate_mode,
            geo.chunk,
            geo.num_chunks,
            geo.padded_key_dim,
            geo.padded_value_dim,
            self.block_sizes.value_tile(geo.padded_value_dim),
            states_per_row=geo.states_per_row,
            varlen=geo.varlen,
        )

    def sequential_specs(self) -> ChunkSpecs:
        """Specs of the kernels walking time (forward, recomputed states, state gradients): as
        `specs`, with several chunks per grid step (packed sequences may start and end inside a
        step: their states then move by DMA, see `packed`)."""
        return self.specs().with_chunks_per_step(self.block_sizes.block_chunks)

    def dv_specs(self) -> ChunkSpecs:
        """Specs of the dv kernel: V tiled, all of K, several chunks per grid step."""
        return self.specs().with_chunks_per_step(self.block_sizes.block_chunks)

    @property
    def token_major(self) -> bool:
        """Whether the call takes the kernels on the op's own token-major arrays (`token_pipeline`):
        fixed length and sizes that fit (`heads.TokenGeometry.fits`)."""
        geo = self.geometry
        if geo.varlen or self.head_major_only:
            return False
        return TokenGeometry.fits(geo.seq_len, geo.num_heads, geo.key_dim, geo.value_dim, geo.chunk, self.compute_dtype)

    @property
    def fused_backward(self) -> bool:
        """Whether the backward is one kernel (`bwd.chunk_bwd`: a per-key gate with all of K and V in
        one block) rather than the split kernels, so the forward keeps the state before every chunk."""
        return bwd.fits(self.specs())

    def dqkg_specs(self) -> ChunkSpecs:
        """Specs of the dq/dk/dgate kernel: K tiled, all of V, several chunks per grid step."""
        specs = self.specs().key_tiled(self.block_sizes.key_tile(self.geometry.padded_key_dim))
        return specs.with_chunks_per_step(self.block_sizes.block_chunks)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KernelInputs:
    """The op's arrays in the kernels' layout (see `prepare`), and the residuals of the VJP.

    q, k: [B, H, Tp, Kp]; v: [B, H, Tp, Vp] (compute dtype); gate: per-step log decays
    [B, H, NT, 1, C], [B, H, Tp, Kp] or [B, H, NT / n, n*C / 128, 128] by the config's gate mode
    (float32); h0: [N, H, Vp, Kp] float32 or None;
    meta: per-chunk metadata; layout: the varlen chunk layout or None;
    scores: the forward's intra-chunk scores [B, H, NF, NT, C, C] (residual of the VJP) or None;
    states: the state before every chunk [B, H, NT, Vp, Kp] float32 (residual of the VJP for the
    fused backward) or None.
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    gate: jax.Array
    h0: jax.Array | None
    meta: prepare.ChunkMeta
    layout: varlen.ChunkLayout | None
    scores: jax.Array | None = None
    states: jax.Array | None = None
    # Whether the backward multiplies in float32 for the gate gradient (`gate_grad_in_float32`).
    float32_gate_grad: bool = dataclasses.field(default=False, metadata=dict(static=True))


def kernel_inputs(config: ChunkConfig, q, k, v, g, g_gamma, gk, initial_state, cu_seqlens) -> KernelInputs:
    """Re-lays the op's arguments for the kernels (XLA: pads, transposes, varlen gathers)."""
    geo = config.geometry
    layout = geo.chunk_layout(cu_seqlens)
    if config.gate_mode == "key":
        gate = prepare.key_gate(gk, geo, layout)
    else:  # g + g_gamma per step; without either, a zero log decay
        a = jnp.zeros((geo.batch, geo.seq_len, geo.num_heads), jnp.float32)
        if g is not None:
            a = a + g.astype(jnp.float32)
        if g_gamma is not None:
            a = a + g_gamma.astype(jnp.float32)
        if config.gate_mode == "broadcast":
            gate = prepare.broadcast_gate(a, geo, layout, config.step_len)
        else:
            gate = prepare.scalar_gate(a, geo, layout)
    return KernelInputs(
        *(prepare.to_kernel(x, geo, layout, config.compute_dtype) for x in (q, k, v)),
        gate=gate,
        h0=prepare.state_in(initial_state, geo) if initial_state is not None else None,
        meta=prepare.chunk_meta(geo, layout),
        layout=layout,
    )


def _forward(config: ChunkConfig, q, k, v, g, g_gamma, gk, initial_state, cu_seqlens, for_backward=False):
    if config.token_major:
        return token_pipeline.forward(config, q, k, v, g, g_gamma, gk, initial_state, for_backward=for_backward)
    geo, specs = config.geometry, config.sequential_specs()
    x = kernel_inputs(config, q, k, v, g, g_gamma, gk, initial_state, cu_seqlens)
    o, ht, scores, states = chunk_fwd(
        x.q,
        x.k,
        x.v,
        x.gate,
        x.h0,
        x.meta,
        specs=specs,
        scale=config.scale,
        output_final_state=config.output_final_state,
        interpret=config.interpret,
        keep_scores=for_backward,
        keep_states=for_backward and config.fused_backward,
        anchor_range=config.anchor_range,
    )
    x = dataclasses.replace(x, scores=scores, states=states)
    o = prepare.from_kernel(o, geo, x.layout, geo.value_dim, v.dtype)
    if ht is not None:
        ht = prepare.state_out(ht, geo)
        if x.layout is not None:
            ht = x.layout.pass_through_empty(ht, initial_state)
    return (o, ht), x


def _forward_for_backward(config: ChunkConfig, *arrays):
    """`_forward` for the VJP: the residuals also hold the intra-chunk scores (for `chunk_bwd_dv` or
    `chunk_bwd`) and, for the fused backward, the state before every chunk."""
    return _forward(config, *arrays, for_backward=True)


def _backward(config: ChunkConfig, x, cotangents):
    do, dht = cotangents
    has_dht = config.output_final_state and dht is not None
    if isinstance(x, token_pipeline.TokenResiduals):
        return (*token_pipeline.backward(config, x, do, dht if has_dht else None), None)
    qk, kk, vk, gate, h0, meta, layout = x.q, x.k, x.v, x.gate, x.h0, x.meta, x.layout
    geo, specs = config.geometry, config.sequential_specs()
    interpret, scale = config.interpret, config.scale
    dok = prepare.to_kernel(do, geo, layout, config.compute_dtype)
    dhtk = prepare.state_in(dht, geo) if has_dht else None
    if config.fused_backward:
        dq, dk, dv, da, dh0 = bwd.chunk_bwd(
            qk,
            kk,
            vk,
            dok,
            gate,
            x.states,
            x.scores,
            dhtk,
            meta,
            specs=specs.reversed(),
            scale=scale,
            need_dh0=h0 is not None,
            anchor_range=config.anchor_range,
            interpret=interpret,
        )
        return (*op_gradients(config, layout, dq, dk, dv, da, dh0, dht if has_dht else None), None)
    h, _ = chunk_fwd_h(kk, vk, gate, h0, meta, specs=specs, output_final_state=False, interpret=interpret)
    dh, dh0 = chunk_bwd_dh(
        qk,
        dok,
        gate,
        dhtk,
        meta,
        specs=specs.reversed(),
        scale=scale,
        need_dh0=h0 is not None,
        interpret=interpret,
    )
    dv_specs = config.dv_specs()
    dv = chunk_bwd_dv(kk, dok, gate, dh, x.scores, specs=dv_specs, scale=scale, dtype=qk.dtype, interpret=interpret)
    dq, dk, da = chunk_bwd_dqkg(
        qk,
        kk,
        vk,
        dok,
        gate,
        h,
        dh,
        specs=config.dqkg_specs(),
        scale=scale,
        interpret=interpret,
        float32_products=x.float32_gate_grad,
        anchor_range=config.anchor_range,
    )
    return (*op_gradients(config, layout, dq, dk, dv, da, dh0, dht if has_dht else None), None)


def op_gradients(config: ChunkConfig, layout, dq, dk, dv, da, dh0, dht):
    """The kernels' gradients back in the op's layout and input dtypes.

    Args:
      config: the call's config; layout: its varlen chunk layout or None.
      dq, dk: [B, H, Tp, Kp]; dv: [B, H, Tp, Vp]; da: the gate gradient of `chunk_bwd_dqkg`;
      dh0: [N, H, Vp, Kp] float32 initial-state gradients or None;
      dht: the final-state cotangent [N, H, K, V] or None (passed through empty sequences).

    Returns:
      (dq, dk, dv, dg, dg_gamma, dgk, d_initial_state), None for arguments the call lacks.
    """
    geo = config.geometry
    dq = prepare.from_kernel(dq, geo, layout, geo.key_dim, config.dtype_of("q"))
    dk = prepare.from_kernel(dk, geo, layout, geo.key_dim, config.dtype_of("k"))
    dv = prepare.from_kernel(dv, geo, layout, geo.value_dim, config.dtype_of("v"))
    dg = dg_gamma = dgk = d_initial = None
    if config.gate_mode == "key":
        dgk = prepare.key_gate_grad(da, geo, layout).astype(config.dtype_of("gk"))
    else:
        to_op = prepare.broadcast_gate_grad if config.gate_mode == "broadcast" else prepare.scalar_gate_grad
        da = to_op(da, geo, layout)  # [B, T, H]
        if config.has("g"):
            dg = da.astype(config.dtype_of("g"))
        if config.has("g_gamma"):
            dg_gamma = jnp.sum(da, axis=(0, 1)).astype(config.dtype_of("g_gamma"))
    if dh0 is not None:
        d_initial = prepare.state_out(dh0, geo)
        if layout is not None:
            d_initial = layout.pass_through_empty(d_initial, dht)
        d_initial = d_initial.astype(config.dtype_of("initial_state"))
    return dq, dk, dv, dg, dg_gamma, dgk, d_initial


def define_chunk_vjp(
    fn,
    forward,
    backward,
    *,
    implementation: str,
    op: str,
    g_gamma_argnum: int,
    for_float32_gate_grad: Callable | None = None,
) -> None:
    """Gives `fn` (a `jax.custom_vjp` whose argument 0 is its static config) its VJP.

    `forward(config, *arrays) -> (outputs, KernelInputs)` and `backward(config, x, (do, dht))`
    are guarded against higher-order differentiation. The VJP sees symbolic zeros: a zero
    cotangent of the output is passed as zeros, of the final state as None; and when argument
    `g_gamma_argnum` (g_gamma) is differentiated and the kernels multiply in bfloat16, the
    residuals ask the backward for float32 products in the gate gradient
    (`KernelInputs.float32_gate_grad`).

    d g_gamma sums d/da over every step of the batch; that sum can cancel to a small part of its
    terms (a fuzzed bfloat16 case: 85 out of 4400), so bfloat16 rounding of the states and scores,
    harmless for each step's d/da, was 10% of it. float32 products cost the dq/dk/gate kernel
    more MXU passes, so they are used only when d g_gamma is needed; `for_float32_gate_grad(config)`,
    if given, is the config the forward and the backward then run with.
    """
    guarded_forward = first_order_only(forward, implementation=implementation, op=op, nondiff_argnums=(0,))
    guarded_backward = first_order_only(backward, implementation=implementation, op=op, nondiff_argnums=(0,))

    def forward_rule(config, *primals):  # primals: CustomVJPPrimal(value, perturbed) or None
        g_gamma = primals[g_gamma_argnum - 1]
        float32_gate_grad = g_gamma is not None and g_gamma.perturbed and config.compute_dtype != jnp.float32
        if float32_gate_grad and for_float32_gate_grad is not None:
            config = for_float32_gate_grad(config)
        outputs, x = guarded_forward(config, *(None if p is None else p.value for p in primals))
        return outputs, dataclasses.replace(x, float32_gate_grad=bool(float32_gate_grad))

    def backward_rule(config, x, cotangents):
        do, dht = cotangents
        if isinstance(do, jax.custom_derivatives.SymbolicZero):
            do = jnp.zeros(do.aval.shape, do.aval.dtype)
        if isinstance(dht, jax.custom_derivatives.SymbolicZero):
            dht = None
        if x.float32_gate_grad and for_float32_gate_grad is not None:
            config = for_float32_gate_grad(config)  # the config the forward ran with
        return guarded_backward(config, x, (do, dht))

    fn.defvjp(forward_rule, backward_rule, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunk_attention(config, q, k, v, g, g_gamma, gk, initial_state, cu_seqlens):
    return _forward(config, q, k, v, g, g_gamma, gk, initial_state, cu_seqlens)[0]


define_chunk_vjp(
    _chunk_attention,
    _forward_for_backward,
    _backward,
    implementation=IMPLEMENTATION,
    op=OPS,
    g_gamma_argnum=5,
    for_float32_gate_grad=lambda config: dataclasses.replace(config, head_major_only=True, chunkwise_scalar_gate=True),
)


def chunk_gated_attention(
    q,
    k,
    v,
    *,
    g=None,
    g_gamma=None,
    gk=None,
    scale: float | None = None,
    initial_state=None,
    output_final_state: bool = False,
    cu_seqlens=None,
    chunk_size: int = 64,
    interpret: bool = False,
    block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES,
    anchor_range: float | None = None,
):
    """Gated linear attention on the Pallas TPU chunk kernels (simple_gla and gla).

    `S_t = diag(e^{a_t}) S_{t-1} + k_t v_t^T`, `o_t = scale * q_t^T S_t`, with the per-step
    log decay `a_t = g_t + g_gamma` (scalar per head, either or both may be absent) or
    `a_t = gk_t` (per key). Arguments are already validated (see `gla_core.validation`).

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V] (bfloat16 or float32; other float dtypes are
        computed in float32).
      g: [B, T, H] or None; g_gamma: [H] or None; gk: [B, T, H, K] or None (not with g/g_gamma).
      scale: multiplies q; None means K ** -0.5.
      initial_state: [N, H, K, V] or None (N = B, or the number of sequences with cu_seqlens).
      output_final_state: also return the final states [N, H, K, V] float32.
      cu_seqlens: int32 [N+1] packed sequence boundaries (B == 1), may be traced.
      chunk_size: 16, 32, 64 or 128.
      interpret: run the kernels in TPU interpret mode.
      block_sizes: kernel tile sizes.
      anchor_range: for gk, the largest in-chunk exponent of the anchored fast path (steps beyond
        it are recomputed exactly); None: the default of the compute dtype, 0: always exact.

    Returns:
      (o [B, T, H, V] in v's dtype, final_state or None). Differentiable in q, k, v, g,
      g_gamma, gk and initial_state.
    """
    if gk is not None and (g is not None or g_gamma is not None):
        raise ValueError("gk (per-key decay) cannot be combined with g or g_gamma")
    if has_no_tokens(q):
        num_states = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        return empty_attention(
            q, v, initial_state=initial_state, num_states=num_states, output_final_state=output_final_state
        )
    config = ChunkConfig.create(
        q,
        v,
        chunk_size=chunk_size,
        scale=scale,
        output_final_state=output_final_state,
        num_sequences=None if cu_seqlens is None else cu_seqlens.shape[0] - 1,
        interpret=interpret,
        block_sizes=block_sizes,
        anchor_range=anchor_range,
        k=k,
        g=g,
        g_gamma=g_gamma,
        gk=gk,
        initial_state=initial_state,
    )
    o, final_state = _chunk_attention(config, q, k, v, g, g_gamma, gk, initial_state, cu_seqlens)
    return o, (final_state if output_final_state else None)
