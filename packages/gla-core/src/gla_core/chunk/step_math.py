"""One grid step of the per-key chunk kernels, on values: the math every launcher shares.

Operands hold M = G*n chunks along a leading axis: G independent groups (the heads a step takes)
of n consecutive chunks each (group g's chunks are rows g*n .. g*n + n - 1); states are `[G, V, K]`
(stored transposed, see `common`). With b_t the sum of a chunk's log decays through step t, L its
last step, S_c the state before chunk c and G_c the gradient of the state after it:

    o_t     = scale * ( (q_t * e^{b_t}) S_c  +  sum_{s<=t} A_ts v_s ),  A_ts = sum_k q_tk k_sk e^{b_tk - b_sk}
    S_{c+1} = diag(e^{b_L}) S_c + sum_t (k_t * e^{b_L - b_t}) v_t^T
    G_{c-1} = diag(e^{b_L}) G_c + scale * sum_t (q_t * e^{b_t}) do_t^T
    dv_s    = (k_s * e^{b_L - b_s}) G_c + scale * sum_{t>=s} A_ts do_t
    dq_t    = scale * ( e^{b_t} * (S_c do_t) + sum_{s<=t} dA_ts k_s e^{b_t - b_s} ),   dA_ts = do_t . v_s
    dk_s    = e^{b_L - b_s} * (G_c v_s) + scale * sum_{t>=s} dA_ts q_t e^{b_t - b_s}
    d loss / d a_u = sum_{t>=u} d loss / d b_t, each term summed only over the steps it reaches

The decays come from `anchored.StepDecays`, the gated products from `products` (anchored or
exact levels): a kernel runs a step with the anchored products and recomputes it with the level
products where the step is out of the anchor range.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_core.chunk.anchored import StepDecays
from gla_core.chunk.batched import causal_dot, causal_mask, state_chain
from gla_core.chunk.common import BATCHED_NN, BATCHED_NT, BATCHED_TN, dot, mask_dot, split_for_mask_dot
from gla_core.chunk.gates import GATE_FLOOR, KeyMaskTable
from gla_core.chunk.products import AnchoredProducts, LevelProducts, recompute_products


@dataclasses.dataclass(frozen=True)
class ForwardStep:
    """One step's forward, float32: scores `[M, C, C]` (A, zero above the diagonal), inter
    `[M, C, V]` (the state's part of the unscaled output), states `[M, V, K]` (before each chunk),
    end `[G, V, K]` (the state leaving the step)."""

    scores: jax.Array
    inter: jax.Array
    states: jax.Array
    end: jax.Array


def forward_step(decays: StepDecays, products, q, k, v, start, *, dtype, edges=None) -> ForwardStep:
    """Args: q, k `[M, C, K]` float32; v `[M, C, V]`; start `[G, V, K]` float32; edges: packed
    sequences' edges inside the step (`packed.ChainEdges`) or None."""
    scores = products.scores(q, k)
    updates = dot(v, k * decays.to_end, BATCHED_TN, dtype)  # [M, V, K]
    states, end = state_chain(start, decays.last_decay, updates, edges=edges)
    inter = dot(q * decays.from_start, states, BATCHED_NT, dtype)  # [M, C, V]
    return ForwardStep(scores, inter, states, end)


def outputs(step: ForwardStep, v, *, scale, dtype) -> jax.Array:
    """o `[M, C, V]` float32 of a step whose values are all finite (the intra part without masks)."""
    return scale * (step.inter + dot(step.scores, v, BATCHED_NN, dtype))


def _triangular_sum(table_ref, block: int, x: jax.Array) -> jax.Array:
    """`mask @ x` per chunk for block `block` of the key mask table and x `[M, C, K]` float32."""
    chunk = x.shape[1]
    return mask_dot(table_ref[pl.ds(block * chunk, chunk), :], split_for_mask_dot(x))


def gradients(decays: StepDecays, products, a, q, k, v, do, states, grads, table_ref, *, scale, dtype):
    """dq, dk and d loss / d a, each `[M, C, K]` float32.

    Args:
      decays, products: the step's decays and gated products; a: its `[M, C, K]` log decays.
      q, k: `[M, C, K]` float32; v, do: `[M, C, V]`; states, grads: `[M, V, K]` float32, the state
      before each chunk and the gradient of the state after it; table_ref: the `KeyMaskTable` ref.
    """
    chunks, chunk = q.shape[:2]
    d_scores = dot(do, v, BATCHED_NT, dtype)  # [M, C, C]
    rows = jax.lax.broadcasted_iota(jnp.int32, d_scores.shape, 1)
    cols = jax.lax.broadcasted_iota(jnp.int32, d_scores.shape, 2)
    d_diagonal = jnp.sum(jnp.where(rows == cols, d_scores, 0.0), axis=2, keepdims=True)  # [M, C, 1]
    strict = jnp.where(causal_mask(chunks, chunk, strict=True), d_scores, 0.0)
    q_strict, k_strict = products.left_right_strict(strict, k, q)  # [M, C, K]
    dq_inter = dot(do, states, BATCHED_NN, dtype) * decays.from_start  # [M, C, K]
    dk_inter = dot(v, grads, BATCHED_NN, dtype) * decays.to_end  # [M, C, K]
    dq = scale * (dq_inter + q_strict + d_diagonal * k)
    dk = dk_inter + scale * (k_strict + d_diagonal * q)
    # Summed over u <= t, pairs of terms that cancel exactly (the diagonal t = s of q*dq and k*dk;
    # k_s * dk_inter_s at step s and at the chunk end) would leave rounding noise far above the small
    # gate gradient of fast decays, so each term is summed only over the u it reaches.
    after = scale * (q * (dq_inter + q_strict) - k * k_strict)
    total = decays.last_decay * jnp.sum(states * grads, axis=1, keepdims=True)  # [M, 1, K]
    table = KeyMaskTable(chunk)
    da = (
        _triangular_sum(table_ref, table.from_u_on, after)
        + _triangular_sum(table_ref, table.before_u, k * dk_inter)
        + total
    )
    return dq, dk, jnp.where(a <= GATE_FLOOR, 0.0, da)


@dataclasses.dataclass(frozen=True)
class BackwardStep:
    """One step's backward, float32: dv `[M, C, V]`, grads `[M, V, K]` (the gradient of the state
    after each chunk), end `[G, V, K]` (the gradient of the state entering the step)."""

    dv: jax.Array
    grads: jax.Array
    end: jax.Array


def backward_step(decays: StepDecays, q, k, do, scores, grad_start, *, scale, dtype, edges=None) -> BackwardStep:
    """The state-gradient chain and dv, exact for any gates (no gated products).

    Args:
      q, k: `[M, C, K]` float32; do: `[M, C, V]`; scores: the forward's A `[M, C, C]`;
      grad_start: `[G, V, K]` float32, the gradient of the state leaving the step;
      edges: packed sequences' edges inside the step (`packed.ChainEdges`, walked backwards) or None.
    """
    updates = scale * dot(do, q * decays.from_start, BATCHED_TN, dtype)  # [M, V, K]
    grads, end = state_chain(grad_start, decays.last_decay, updates, reverse=True, edges=edges)
    from_state = dot(k * decays.to_end, grads, BATCHED_NT, dtype)  # [M, C, V]
    intra = dot(scores, do, BATCHED_TN, dtype)  # [M, C, V]
    return BackwardStep(from_state + scale * intra, grads, end)


def run_forward(
    decays: StepDecays, a, table_ref, q, k, v, start, write, *, scale, dtype, chunk: int, edges=None
) -> None:
    """A step's forward with the anchored products, recomputed where they do not serve.

    Calls `write(step, o)` (o `[M, C, V]` float32) with the anchored products (or, without an
    anchor range, the exact ones), and again under `pl.when` where needed: with the same products
    and the values masked when a value is not finite (a non-finite v_s reaches earlier rows
    through the zeros above the diagonal; a non-finite k_s only rows t >= s), so the rows
    before it keep exactly their numbers; with the blocked or exact level products
    (`products.recompute_products`) when the step is out of the anchor range (the static estimate
    counts only the first call, see `anchored`).

    Args: a `[M*C, K]` float32 log decays; q, k `[M, C, K]` float32; v `[M, C, V]`; start `[G, V, K]`;
    edges: packed sequences' edges inside the step (`packed.ChainEdges`; a recomputed step runs its
    chain, and so its DMAs, again) or None.
    """

    def recomputed(products):
        step = forward_step(decays, products, q, k, v, start, dtype=dtype, edges=edges)
        write(step, scale * (step.inter + causal_dot(step.scores, v, dtype)))

    if decays.anchor_range is None:
        recomputed(LevelProducts(a, table_ref, chunk, dtype))
        return
    step = forward_step(decays, AnchoredProducts(decays, dtype), q, k, v, start, dtype=dtype, edges=edges)
    write(step, outputs(step, v, scale=scale, dtype=dtype))

    # The step's values themselves, not its end state: a hard reset later in the step can drop a
    # non-finite v_s from the state (0 * v by a select, finite) while the unmasked product still
    # carried it into the rows before s.
    values_finite = jnp.max(jnp.where(jnp.isfinite(v.astype(jnp.float32)), 0.0, 1.0)) == 0.0

    @pl.when(decays.in_range & jnp.logical_not(values_finite))
    def _masked():
        write(step, scale * (step.inter + causal_dot(step.scores, v, dtype)))

    @pl.when(jnp.logical_not(decays.in_range))
    def _recompute():
        recompute_products(a, table_ref, chunk, decays.anchor_range, dtype, recomputed)


def run_gradients(decays: StepDecays, a, table_ref, operands, write, *, scale, dtype, chunk: int) -> None:
    """dq, dk and d loss / d a of a step (`gradients` of `operands`, everything after its decays and
    products): `write(dq, dk, da)` with the anchored products (or, without an anchor range, the exact
    ones), and again under `pl.when` with the blocked or the exact level products
    (`products.recompute_products`) when out of the anchor range.

    Args: a `[M*C, K]` float32 log decays."""

    def with_products(products):
        write(*gradients(decays, products, *operands, scale=scale, dtype=dtype))

    if decays.anchor_range is None:
        with_products(LevelProducts(a, table_ref, chunk, dtype))
        return
    with_products(AnchoredProducts(decays, dtype))

    @pl.when(jnp.logical_not(decays.in_range))
    def _recompute():
        recompute_products(a, table_ref, chunk, decays.anchor_range, dtype, with_products)
