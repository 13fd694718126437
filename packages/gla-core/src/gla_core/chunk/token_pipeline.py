"""The chunk op on the op's own token-major arrays (`heads`), forward and backward.

Forward:  the free `[B, T*H, D]` views of q, k, v and gk (or the scalar gate g + g_gamma as
          `[B, T, H]`) -> `token_fwd` (o, the final states and, under differentiation, every
          chunk's scores and first state) -> o's view back.
Backward: the view of do -> `token_bwd` (dq, dk, dv, the gate gradient and d h0 in one kernel) ->
          views back (d g_gamma: the scalar gate gradient summed over B and T).

Only the states (h0, ht, dht, dh0: `[B, H, K, V]`, 1/T of the tokens' bytes) are re-laid out in
XLA, to the kernels' transposed `[B, H, V, K]`. `pipeline` routes a call here when it fits
(`TokenGeometry.fits`, fixed length); the same custom VJP guards apply (first-order only, vmap
folded into B).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gla_core.chunk import prepare
from gla_core.chunk.gates import floor_gates
from gla_core.chunk.heads import TokenGeometry
from gla_core.chunk.specs import chunks_per_step
from gla_core.chunk.token_bwd import token_bwd
from gla_core.chunk.token_fwd import token_fwd
from gla_core.pallas_transforms import fold_vmap
from gla_core.token_major import merge_heads, split_heads


def geometry(config, step_chunks: int) -> TokenGeometry:
    """The `TokenGeometry` of a `pipeline.ChunkConfig` that fits the token-major kernels: n the
    largest divisor of T / C with n * H <= max(`step_chunks`, H) and n <= the config's block_chunks.
    The forward and the backward may take different n: what the forward keeps is laid out per chunk."""
    geo = config.geometry
    most = max(1, min(config.block_sizes.block_chunks, step_chunks // geo.num_heads))
    steps = chunks_per_step(geo.num_chunks, most)
    return TokenGeometry(
        geo.seq_len,
        geo.num_heads,
        geo.key_dim,
        geo.value_dim,
        geo.chunk,
        steps,
        interpret=config.interpret,
        scalar_gate=config.gate_mode != "key",
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenResiduals:
    """What the backward needs: the kernels' views of q, k, v [B, T*H, D] (compute dtype) and the
    floored gate float32 ([B, T*H, K] per key, [B, T, H] scalar), h0 [B, H, V, K] float32 or None,
    and what the forward kept: scores [B, NT, H, C, C] and states [B, NT, H, V, K]."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    gate: jax.Array
    h0: jax.Array | None
    scores: jax.Array | None = None
    states: jax.Array | None = None
    # Always False: a call whose gate gradient needs float32 products takes the head-major kernels
    # (`pipeline.ChunkConfig.head_major_only`); `define_chunk_vjp` sets it on either residuals.
    float32_gate_grad: bool = dataclasses.field(default=False, metadata=dict(static=True))


def gate_view(config, g, g_gamma, gk) -> jax.Array:
    """The kernels' floored float32 gate: gk as [B, T*H, K], else g + g_gamma as [B, T, H] (zero
    log decays without either)."""
    if gk is not None:
        return merge_heads(floor_gates(gk.astype(jnp.float32)))
    geo = config.geometry
    a = jnp.zeros((geo.batch, geo.seq_len, geo.num_heads), jnp.float32)
    if g is not None:
        a = a + g.astype(jnp.float32)
    if g_gamma is not None:
        a = a + g_gamma.astype(jnp.float32)
    return floor_gates(a)


def forward(config, q, k, v, g, g_gamma, gk, initial_state, *, for_backward: bool):
    """((o [B, T, H, V], final state [B, H, K, V] float32 or None), `TokenResiduals`)."""
    sizes = config.block_sizes
    geo = geometry(config, sizes.training_step_chunks if for_backward else sizes.step_chunks)
    views = [merge_heads(x.astype(config.compute_dtype)) for x in (q, k, v)]
    gate = gate_view(config, g, g_gamma, gk)
    h0 = prepare.state_in(initial_state, config.geometry) if initial_state is not None else None

    def launch(q, k, v, gate, h0):
        return token_fwd(
            q,
            k,
            v,
            gate,
            h0,
            geo=geo,
            scale=config.scale,
            output_final_state=config.output_final_state,
            keep=for_backward,
            anchor_range=config.anchor_range,
        )

    o, ht, scores, states = fold_vmap(launch, (*views, gate, h0), in_axes=(0,) * 5, out_axes=0)
    o = split_heads(o, geo.num_heads).astype(v.dtype)
    ht = prepare.state_out(ht, config.geometry) if ht is not None else None
    return (o, ht), TokenResiduals(*views, gate, h0, scores, states)


def backward(config, x: TokenResiduals, do, dht):
    """(dq, dk, dv, dg, dg_gamma, dgk, d initial_state) in the op's layouts and input dtypes (None
    where absent)."""
    geo = geometry(config, config.block_sizes.training_step_chunks)
    h = geo.num_heads
    dht = prepare.state_in(dht, config.geometry) if dht is not None else None

    def launch(q, k, v, do, gate, states, scores, dht):
        return token_bwd(
            q,
            k,
            v,
            do,
            gate,
            states,
            scores,
            dht,
            geo=geo,
            scale=config.scale,
            need_dh0=x.h0 is not None,
            anchor_range=config.anchor_range,
        )

    arrays = (x.q, x.k, x.v, merge_heads(do.astype(config.compute_dtype)), x.gate, x.states, x.scores, dht)
    dq, dk, dv, da, dh0 = fold_vmap(launch, arrays, in_axes=(0,) * 8, out_axes=0)
    dq, dk = (split_heads(g, h).astype(config.dtype_of(name)) for g, name in ((dq, "q"), (dk, "k")))
    dv = split_heads(dv, h).astype(config.dtype_of("v"))
    dg = dg_gamma = dgk = None
    if geo.scalar_gate:
        if config.has("g"):
            dg = da.astype(config.dtype_of("g"))
        if config.has("g_gamma"):
            dg_gamma = jnp.sum(da, axis=(0, 1)).astype(config.dtype_of("g_gamma"))
    else:
        dgk = split_heads(da, h).astype(config.dtype_of("gk"))
    d_initial = None
    if dh0 is not None:
        d_initial = prepare.state_out(dh0, config.geometry).astype(config.dtype_of("initial_state"))
    return dq, dk, dv, dg, dg_gamma, dgk, d_initial
