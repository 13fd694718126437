"""Each chunk kernel family alone, in TPU interpret mode, against the float64 oracle.

Every kernel gets exact float64 inputs where it consumes another kernel's output (the states
before every chunk, the gradients of the states after every chunk), computed from the
token-by-token recurrence of `gla_ref.recurrent`, so an error is the kernel's own:

  S_c  state before chunk c: the recurrence run over chunks < c
  G_c  gradient of the state after chunk c, with the oracle's cotangents
  A    intra-chunk scores A[t, s] = sum_k q_tk k_sk e^{b_tk - b_sk}, s <= t in one chunk

Problems: T not a multiple of the chunk, K and V not multiples of 128, h0 and final state,
B = 2, K (and for the chunk-by-chunk scalar gate V) padded to two 128-lane tiles; the scalar gate
is g + g_gamma, the per-key gate gk. Gate modes (`ChunkSpecs.gate_mode`): "scalar" (V in two tiles,
so the scalar gate is taken chunk by chunk), "broadcast" (one V tile: the same scalar gate broadcast
over the keys by the step kernels, C = 128 so every grid step fills 128-lane rows) and "key".
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_core.chunk import BlockSizes, prepare
from gla_core.chunk.bwd import chunk_bwd
from gla_core.chunk.bwd_dh import chunk_bwd_dh
from gla_core.chunk.bwd_dqkg import chunk_bwd_dqkg
from gla_core.chunk.bwd_dv import chunk_bwd_dv
from gla_core.chunk.fwd import chunk_fwd
from gla_core.chunk.fwd_h import chunk_fwd_h
from gla_core.chunk.gates import KeyMaskTable
from gla_core.chunk.pipeline import ChunkConfig, kernel_inputs
from gla_ref import recurrent
from gla_ref.testing import TOLERANCES, assert_close, cotangents, make_case, oracle

pytestmark = pytest.mark.interpret

TOL = TOLERANCES["float32"]
CHUNK = 32


@dataclasses.dataclass(frozen=True)
class Problem:
    """A case, its kernel inputs, and float64 references (numpy)."""

    case: object
    config: ChunkConfig
    inputs: object  # KernelInputs
    do: jax.Array  # [B, H, Tp, Vp] cotangent of o in the kernel layout
    dht: jax.Array  # [N, H, Vp, Kp] cotangent of the final state in the kernel layout
    states: np.ndarray  # S_c [B, NT, H, K, V]
    state_grads: np.ndarray  # G_c [B, NT, H, K, V]
    scores: np.ndarray  # A [B, H, NT, C, C]
    reference: object  # OracleResult


def _make_case(mode: str):
    if mode in ("scalar", "broadcast"):
        return make_case(
            "simple_gla",
            batch=2,
            seq_len=80 if mode == "scalar" else 250,
            key_dim=160,
            value_dim=150 if mode == "scalar" else 100,
            gates=("g", "g_gamma"),
            initial_state=True,
            output_final_state=True,
            chunk_size=CHUNK,
            seed=3,
        )
    return make_case(
        "gla", batch=2, seq_len=80, key_dim=160, value_dim=48, initial_state=True, output_final_state=True, seed=4
    )


def _run_recurrence(case, inputs, start: int, stop: int, state, scale: float):
    """The recurrence over steps [start, stop) from `state`: (o, final state), float64."""
    time_sliced = {n: x[:, start:stop] for n, x in inputs.items() if n in ("q", "k", "v", "g", "gk")}
    constant = {n: inputs[n] for n in ("g_gamma",) if n in inputs}
    fn = recurrent.simple_gla if case.op == "simple_gla" else recurrent.gla
    return fn(**time_sliced, **constant, scale=scale, initial_state=state, output_final_state=True)


def _references(case, scale: float, num_chunks: int, do: np.ndarray, dht: np.ndarray):
    """S_c and G_c of every chunk, float64 [B, NT, H, K, V].

    The recurrence runs chunk by chunk with a zero perturbation added to the state after
    every chunk; the VJP w.r.t. the perturbations is G.
    """
    seq_len = case.inputs["q"].shape[1]
    with jax.enable_x64(True):
        inputs = {n: jnp.asarray(np.asarray(x, np.float64)) for n, x in case.inputs.items()}
        initial = inputs["initial_state"]

        def chunk_by_chunk(perturbations):
            state, outputs, states = initial, [], []
            for c in range(num_chunks):
                states.append(state)
                o, state = _run_recurrence(case, inputs, c * CHUNK, min((c + 1) * CHUNK, seq_len), state, scale)
                outputs.append(o)
                state = state + perturbations[c]
            return (jnp.concatenate(outputs, axis=1), state), jnp.stack(states, 1)

        @jax.jit
        def states_and_grads(zeros, do, dht):
            _, vjp, states = jax.vjp(chunk_by_chunk, zeros, has_aux=True)
            (grads,) = vjp((do, dht))
            return states, jnp.moveaxis(grads, 0, 1)

        zeros = jnp.zeros((num_chunks, *initial.shape), jnp.float64)
        states, grads = states_and_grads(zeros, jnp.asarray(do), jnp.asarray(dht))
        return np.asarray(states), np.asarray(grads)


def _scores_reference(case, num_chunks: int) -> np.ndarray:
    """The intra-chunk scores A of every chunk, float64 [B, H, NT, C, C] (zero-padded steps)."""
    inputs = {n: np.asarray(x, np.float64) for n, x in case.inputs.items()}
    q, k = inputs["q"], inputs["k"]
    b, t, h, _ = q.shape
    if "gk" in inputs:
        a = inputs["gk"]
    else:
        a = np.zeros((b, t, h)) + inputs.get("g", 0.0) + inputs.get("g_gamma", 0.0)
        a = a[..., None]
    padded = num_chunks * CHUNK

    def chunks(x):  # [B, T, H, D] -> [B, NT, C, H, D], zero-padded in time
        x = np.pad(x, [(0, 0), (0, padded - t), (0, 0), (0, 0)])
        return x.reshape(b, num_chunks, CHUNK, h, x.shape[-1])

    q, k, cum = chunks(q), chunks(k), np.cumsum(chunks(a), axis=2)
    decay = np.exp(np.minimum(cum[:, :, :, None] - cum[:, :, None, :], 0.0))  # [B, NT, t, s, H, D]; t >= s kept
    scores = np.einsum("bnthd,bnshd,bntshd->bhnts", q, k, decay)
    return np.where(np.tril(np.ones((CHUNK, CHUNK), bool)), scores, 0.0)


def _build(mode: str) -> Problem:
    case = _make_case(mode)
    inputs = case.inputs
    config = ChunkConfig.create(
        inputs["q"],
        inputs["v"],
        chunk_size=CHUNK,
        output_final_state=True,
        interpret=True,
        block_sizes=BlockSizes(block_v=128, block_k=128),
        **{n: inputs.get(n) for n in ("k", "g", "g_gamma", "gk", "initial_state")},
    )
    assert config.gate_mode == mode
    x = kernel_inputs(config, *(inputs.get(n) for n in ("q", "k", "v", "g", "g_gamma", "gk", "initial_state")), None)
    q, v = inputs["q"], inputs["v"]
    shapes = {"o": v.shape, "final_state": (q.shape[0], q.shape[2], q.shape[3], v.shape[3])}
    cts = cotangents(case, shapes, seed=0)
    geo = config.geometry
    states, state_grads = _references(case, config.scale, geo.num_chunks, cts["o"], cts["final_state"])
    return Problem(
        case=case,
        config=config,
        inputs=x,
        do=prepare.to_kernel(jnp.asarray(cts["o"], jnp.float32), geo, None),
        dht=prepare.state_in(jnp.asarray(cts["final_state"], jnp.float32), geo),
        states=states,
        state_grads=state_grads,
        scores=_scores_reference(case, geo.num_chunks),
        reference=oracle(case),
    )


@pytest.fixture(scope="module", params=["scalar", "broadcast", "key"])
def problem(request) -> Problem:
    return _build(request.param)


def _to_kernel_states(states: np.ndarray, problem: Problem) -> jax.Array:
    """[B, NT, H, K, V] float64 to the kernels' [B, H, NT, Vp, Kp] float32."""
    geo = problem.config.geometry
    x = jnp.asarray(np.transpose(states, (0, 2, 1, 4, 3)), jnp.float32)
    return prepare.pad_axis(prepare.pad_axis(x, 3, geo.padded_value_dim), 4, geo.padded_key_dim)


def _from_kernel_states(states: jax.Array, problem: Problem) -> np.ndarray:
    """The kernels' [B, H, NT, Vp, Kp] to [B, NT, H, K, V]."""
    geo = problem.config.geometry
    return np.transpose(np.asarray(states)[:, :, :, : geo.value_dim, : geo.key_dim], (0, 2, 1, 4, 3))


def _gate_grads(da: jax.Array, problem: Problem) -> dict[str, jax.Array]:
    geo = problem.config.geometry
    mode = problem.config.gate_mode
    if mode == "key":
        return {"dgk": prepare.key_gate_grad(da, geo, None)}
    da = (prepare.broadcast_gate_grad if mode == "broadcast" else prepare.scalar_gate_grad)(da, geo, None)
    return {"dg": da, "dg_gamma": jnp.sum(da, axis=(0, 1))}


# The fewest chunks per grid step (one; "broadcast" mode: the 4 chunks of one 128-lane gate row) and
# all NT chunks of the problem in one step (3; "broadcast": 8, two gate rows).
CHUNKS_PER_STEP = ("fewest", "all")


def _specs_and_gate(problem: Problem, specs, chunks_per_step: str):
    """`specs` with the chunks per grid step `chunks_per_step` names, and the gate laid out for them
    (a "broadcast" gate's rows hold the steps of one grid step)."""
    geo, gate = problem.config.geometry, problem.inputs.gate
    fewest = 128 // CHUNK if problem.config.gate_mode == "broadcast" else 1
    specs = specs.with_chunks_per_step(fewest if chunks_per_step == "fewest" else geo.num_chunks)
    if specs.gate_mode == "broadcast":
        gate = gate.reshape(geo.batch, geo.num_heads, -1, specs.chunks_per_step * CHUNK // 128, 128)
    return specs, gate


# The per-key gate's gated products: exact everywhere (0), anchored everywhere (a range above every
# chunk's largest |b_t - b_m|), anchored in some steps and recomputed in the others, or recomputed
# with the blocked products (`products.BlockedProducts`) wherever the chunk-wide anchor is out of range.
ANCHORING = ("exact", "anchored", "mixed", "blocked")


def _anchored_ranges(problem: Problem, block: int = CHUNK) -> np.ndarray:
    """max |b_t - b_m(t)| of every chunk (all rows, heads, keys; m(t) the middle row of t's block of
    `block` steps), float64 [NT]: what the anchored products of `gla_core.chunk.anchored` (block C) or
    the blocked products (block `KeyMaskTable.sub_block`) must accept."""
    inputs = problem.case.inputs
    if "gk" in inputs:
        a = np.asarray(inputs["gk"], np.float64)
    else:  # a scalar gate: one key
        a = np.asarray(inputs["g"], np.float64)[..., None] + np.asarray(inputs["g_gamma"], np.float64)[:, None]
    b, t, h, k = a.shape
    padded = problem.config.geometry.num_chunks * CHUNK
    cum = np.cumsum(np.pad(a, [(0, 0), (0, padded - t), (0, 0), (0, 0)]).reshape(b, -1, CHUNK, h, k), axis=2)
    blocks = cum.reshape(b, cum.shape[1], CHUNK // block, block, h, k)
    anchor = blocks[:, :, :, block // 2 - 1 : block // 2]
    return np.max(np.abs(blocks - anchor), axis=(0, 2, 3, 4, 5))


def _anchor_range(problem: Problem, anchoring: str) -> float:
    if anchoring == "exact" or problem.config.gate_mode == "scalar":
        return 0.0
    ranges = _anchored_ranges(problem)
    if anchoring == "anchored":
        return float(np.max(ranges)) + 1.0
    if anchoring == "blocked":
        within_sub_blocks = float(np.max(_anchored_ranges(problem, KeyMaskTable(CHUNK).sub_block))) + 1e-3
        assert np.max(ranges) > within_sub_blocks, "the problem needs a chunk out of the blocked products' range"
        return within_sub_blocks
    low, high = float(np.min(ranges)), float(np.max(ranges))
    assert high > low + 1e-3, "the problem's chunks need different ranges for a mixed case"
    return (low + high) / 2


@pytest.mark.parametrize("chunks_per_step", CHUNKS_PER_STEP)
def test_fwd_h_states_and_final_state(problem, chunks_per_step, no_races, interpret):
    x, config = problem.inputs, problem.config
    specs, gate = _specs_and_gate(problem, config.specs(), chunks_per_step)
    h, ht = chunk_fwd_h(x.k, x.v, gate, x.h0, x.meta, specs=specs, output_final_state=True, interpret=interpret)
    assert_close("h", _from_kernel_states(h, problem), problem.states, TOL.output)
    final = prepare.state_out(ht, config.geometry)
    assert_close("final_state", final, problem.reference.outputs["final_state"], TOL.output)


@pytest.mark.parametrize("anchoring", ANCHORING)
@pytest.mark.parametrize("chunks_per_step", CHUNKS_PER_STEP)
def test_fwd_outputs_and_final_state(problem, chunks_per_step, anchoring, request, interpret):
    if problem.config.gate_mode == "scalar" and anchoring != "exact":
        pytest.skip("anchored products are those of the step kernels (per-key or broadcast gate)")
    request.getfixturevalue("no_races")  # after the skip: the fixture fails a test that ran no kernel
    x, config = problem.inputs, problem.config
    specs, gate = _specs_and_gate(problem, config.specs(), chunks_per_step)
    o, ht, scores, states = chunk_fwd(
        x.q,
        x.k,
        x.v,
        gate,
        x.h0,
        x.meta,
        specs=specs,
        scale=config.scale,
        output_final_state=True,
        interpret=interpret,
        keep_scores=True,
        keep_states=True,
        anchor_range=_anchor_range(problem, anchoring),
    )
    assert_close("h", _from_kernel_states(states, problem), problem.states, TOL.output)
    o = prepare.from_kernel(o, config.geometry, None, config.geometry.value_dim)
    assert_close("o", o, problem.reference.outputs["o"], TOL.output)
    final = prepare.state_out(ht, config.geometry)
    assert_close("final_state", final, problem.reference.outputs["final_state"], TOL.output)
    assert scores.shape[2] == specs.num_tiles
    for tile in range(specs.num_tiles):  # every V tile keeps the same scores
        assert_close("scores", scores[:, :, tile], problem.scores, TOL.output)


@pytest.mark.parametrize("chunks_per_step", CHUNKS_PER_STEP)
def test_bwd_dh_state_gradients(problem, chunks_per_step, no_races, interpret):
    x, config = problem.inputs, problem.config
    specs, gate = _specs_and_gate(problem, config.specs(), chunks_per_step)
    dh, dh0 = chunk_bwd_dh(
        x.q,
        problem.do,
        gate,
        problem.dht,
        x.meta,
        specs=specs.reversed(),
        scale=config.scale,
        need_dh0=True,
        interpret=interpret,
    )
    assert_close("dh", _from_kernel_states(dh, problem), problem.state_grads, TOL.grad)
    d_initial = prepare.state_out(dh0, config.geometry)
    assert_close("dinitial_state", d_initial, problem.reference.grads["dinitial_state"], TOL.grad)


@pytest.mark.parametrize("chunks_per_step", CHUNKS_PER_STEP)
def test_bwd_dv(problem, chunks_per_step, interpret):
    x, config = problem.inputs, problem.config
    dh = _to_kernel_states(problem.state_grads, problem)
    specs, gate = _specs_and_gate(problem, config.specs(), chunks_per_step)
    scores = jnp.asarray(problem.scores, jnp.float32)[:, :, None]
    dv = chunk_bwd_dv(
        x.k,
        problem.do,
        gate,
        dh,
        jnp.repeat(scores, specs.num_tiles, axis=2),
        specs=specs,
        scale=config.scale,
        dtype=jnp.float32,
        interpret=interpret,
    )
    dv = prepare.from_kernel(dv, config.geometry, None, config.geometry.value_dim)
    assert_close("dv", dv, problem.reference.grads["dv"], TOL.grad)


@pytest.mark.parametrize("anchoring", ANCHORING)
@pytest.mark.parametrize("chunks_per_step", CHUNKS_PER_STEP)
def test_bwd_dqkg(problem, chunks_per_step, anchoring, interpret):
    if problem.config.gate_mode == "broadcast":
        pytest.skip("a broadcast gate's dq/dk/gate gradients come from the fused backward")
    if problem.config.gate_mode == "scalar" and anchoring != "exact":
        pytest.skip("anchored products are those of the step kernels (per-key or broadcast gate)")
    x, config = problem.inputs, problem.config
    h = _to_kernel_states(problem.states, problem)
    dh = _to_kernel_states(problem.state_grads, problem)
    specs, gate = _specs_and_gate(problem, config.dqkg_specs(), chunks_per_step)
    dq, dk, da = chunk_bwd_dqkg(
        x.q,
        x.k,
        x.v,
        problem.do,
        gate,
        h,
        dh,
        specs=specs,
        scale=config.scale,
        interpret=interpret,
        anchor_range=_anchor_range(problem, anchoring),
    )
    geo = config.geometry
    got = {
        "dq": prepare.from_kernel(dq, geo, None, geo.key_dim),
        "dk": prepare.from_kernel(dk, geo, None, geo.key_dim),
        **_gate_grads(da, problem),
    }
    for name, value in got.items():
        assert_close(name, value, problem.reference.grads[name], TOL.grad)


@pytest.mark.parametrize("anchoring", ANCHORING)
@pytest.mark.parametrize("chunks_per_step", CHUNKS_PER_STEP)
def test_fused_bwd_gradients(problem, chunks_per_step, anchoring, request, interpret):
    """`chunk_bwd` (per-key or broadcast gate) from exact states and scores: every gradient. Its products
    are anchored, so "exact" here is a range below every chunk's (each step recomputed exactly)."""
    if problem.config.gate_mode == "scalar":
        pytest.skip("the fused backward serves the step kernels' gates (per-key or broadcast)")
    request.getfixturevalue("no_races")
    x, config = problem.inputs, problem.config
    anchor_range = _anchor_range(problem, anchoring) if anchoring != "exact" else 1e-6
    specs, gate = _specs_and_gate(problem, config.specs(), chunks_per_step)
    scores = jnp.asarray(problem.scores, jnp.float32)[:, :, None]
    dq, dk, dv, da, dh0 = chunk_bwd(
        x.q,
        x.k,
        x.v,
        problem.do,
        gate,
        _to_kernel_states(problem.states, problem),
        scores,
        problem.dht,
        x.meta,
        specs=specs.reversed(),
        scale=config.scale,
        need_dh0=True,
        anchor_range=anchor_range,
        interpret=interpret,
    )
    geo = config.geometry
    got = {
        "dq": prepare.from_kernel(dq, geo, None, geo.key_dim),
        "dk": prepare.from_kernel(dk, geo, None, geo.key_dim),
        "dv": prepare.from_kernel(dv, geo, None, geo.value_dim),
        "dinitial_state": prepare.state_out(dh0, geo),
        **_gate_grads(da, problem),
    }
    for name, value in got.items():
        assert_close(name, value, problem.reference.grads[name], TOL.grad)
