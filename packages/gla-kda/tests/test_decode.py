"""kda's serving decode path: `fused_recurrent_kda` with a state pool (`ssm_state_indices`).

Against the float64 oracle `gla_ref.decode` (every sequence runs the recurrence from
`initial_state = pool[slot]`; the written slots get its states, every other slot keeps its bytes):
the implementations `decode_xla` (CPU) and `decode` (Pallas, TPU interpret mode), with kda's
in-kernel options, gradients through `decode_xla`, donation, the choice of implementation and
the errors of bad pool arguments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
from gla_core import errors
from gla_kda import fused_recurrent_kda
from gla_ref import decode as reference
from gla_ref.testing import TOLERANCES, assert_close

TOL = TOLERANCES["float32"]
H, HV, K, V, SLOTS = 1, 2, 16, 24, 10


def _inputs(lengths, seed=0):
    """Packed tokens of sequences of `lengths` (raw gate input, beta logits) and a pool."""
    rng = np.random.default_rng(seed)
    total = sum(lengths)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    arrays = dict(
        q=normal(1, total, H, K),
        k=normal(1, total, H, K),
        v=normal(1, total, HV, V),
        g=normal(1, total, HV, K),
        beta=normal(1, total, HV),
        A_log=jnp.asarray(rng.uniform(-1, 0.5, HV), jnp.float32),
        dt_bias=jnp.asarray(rng.normal(-1, 0.5, HV * K), jnp.float32),
        initial_state=normal(SLOTS, HV, K, V),
    )
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return arrays, cu


OPTIONS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def _check(o, pool, arrays, indices, written, **pool_arguments):
    o_ref, pool_ref = reference.float64_oracle(
        "kda", {**arrays, "ssm_state_indices": indices, **pool_arguments}, **OPTIONS
    )
    assert_close("o", o, o_ref, TOL.output, label="kda decode")
    assert_close("written slots", np.asarray(pool)[written], pool_ref[written], TOL.output, label="kda decode")
    kept = [s for s in range(SLOTS) if s not in written]
    np.testing.assert_array_equal(np.asarray(pool)[kept], np.asarray(arrays["initial_state"])[kept])


@pytest.mark.oracle
def test_one_slot_per_sequence_packed():
    arrays, cu = _inputs([1, 0, 2, 1])
    indices = jnp.asarray([4, 7, -1, 0], jnp.int32)  # sequence 1 is empty, sequence 2 is padding
    host = tuple(cu.tolist())  # the host copy gives the longest sequence to 1-D indices under jit
    step = jax.jit(
        lambda arrays, indices, cu: fused_recurrent_kda(
            **arrays, ssm_state_indices=indices, cu_seqlens=cu, cu_seqlens_cpu=host, **OPTIONS
        )
    )
    o, pool = step(arrays, indices, jnp.asarray(cu))
    _check(o, pool, arrays, indices, [4, 0], cu_seqlens=cu)


@pytest.mark.oracle
def test_speculative_decoding_slot_per_token_and_gradients():
    arrays, cu = _inputs([3, 2])
    indices = jnp.asarray([[1, 2, 3], [5, 6, -1]], jnp.int32)
    accepted = jnp.asarray([3, 1], jnp.int32)  # sequence 0 starts from slot 3, sequence 1 from slot 5

    def run(arrays):
        return fused_recurrent_kda(
            **arrays, ssm_state_indices=indices, num_accepted_tokens=accepted, cu_seqlens=jnp.asarray(cu), **OPTIONS
        )

    (o, pool), vjp = jax.vjp(jax.jit(run), arrays)
    _check(o, pool, arrays, indices, [1, 2, 3, 5, 6], num_accepted_tokens=accepted, cu_seqlens=cu)
    # gradients of decode_xla against the float64 oracle's, with the same cotangents
    rng = np.random.default_rng(1)
    do = jnp.asarray(rng.standard_normal(o.shape), jnp.float32)
    dpool = jnp.asarray(rng.standard_normal(pool.shape), jnp.float32)
    (grads,) = vjp((do, dpool))
    with jax.enable_x64(True):
        up = lambda tree: jax.tree.map(lambda x: jnp.asarray(np.asarray(x), jnp.float64), tree)

        def oracle(arrays):
            q, k, v = (arrays.pop(name) for name in ("q", "k", "v"))
            return reference.decode(
                "kda", q, k, v, ssm_state_indices=indices, num_accepted_tokens=accepted, cu_seqlens=cu,
                **arrays, **OPTIONS,
            )  # fmt: skip

        oracle_vjp = jax.jit(lambda arrays, cotangents: jax.vjp(oracle, arrays)[1](cotangents)[0])
        expected = jax.tree.map(np.asarray, oracle_vjp(up(arrays), up((do, dpool))))
    for name in arrays:
        assert_close("d" + name, grads[name], expected[name], TOL.grad, label="kda decode_xla")


@pytest.mark.oracle
def test_per_token_states_and_state_v_first():
    arrays, _ = _inputs([2, 2])
    arrays["initial_state"] = jnp.swapaxes(arrays["initial_state"], -1, -2)  # [P, HV, V, K]
    fixed = {name: x.reshape(2, 2, *x.shape[2:]) if x.shape[:2] == (1, 4) else x for name, x in arrays.items()}
    indices = jnp.asarray([[1, 2], [3, 4]], jnp.int32)
    o, states = fused_recurrent_kda(
        **fixed, ssm_state_indices=indices, inplace_final_state=False, state_v_first=True, **OPTIONS
    )
    o_ref, states_ref = reference.float64_oracle(
        "kda", {**fixed, "ssm_state_indices": indices}, inplace_final_state=False, state_v_first=True, **OPTIONS
    )
    assert states.shape == (2, 2, HV, V, K)
    assert_close("o", o, o_ref, TOL.output, label="kda decode token states")
    assert_close("token states", states, states_ref, TOL.output, label="kda decode token states")


@pytest.mark.interpret
def test_pallas_decode_through_dispatch(interpret):
    arrays, cu = _inputs([2, 1])
    indices = jnp.asarray([[8, 9], [2, -1]], jnp.int32)
    o, pool = fused_recurrent_kda(
        **arrays, ssm_state_indices=indices, cu_seqlens=jnp.asarray(cu), interpret=interpret, **OPTIONS
    )
    _check(o, pool, arrays, indices, [8, 9, 2], cu_seqlens=cu)


def test_donated_pool_is_updated_in_place():
    arrays, _ = _inputs([1, 1])
    fixed = {name: x.reshape(2, 1, *x.shape[2:]) if x.shape[:2] == (1, 2) else x for name, x in arrays.items()}
    indices = jnp.asarray([3, 6], jnp.int32)
    pool = fixed.pop("initial_state")
    expected = fused_recurrent_kda(**fixed, initial_state=pool, ssm_state_indices=indices, **OPTIONS)[1]
    step = jax.jit(
        lambda pool, indices: fused_recurrent_kda(**fixed, initial_state=pool, ssm_state_indices=indices, **OPTIONS),
        donate_argnums=0,
    )
    _, updated = step(jnp.array(pool), indices)
    assert_close("donated pool", updated, expected, TOLERANCES["float32_rearranged"].output)
    kept = [s for s in range(SLOTS) if s not in (3, 6)]
    np.testing.assert_array_equal(np.asarray(updated)[kept], np.asarray(pool)[kept])


def test_choice_of_implementation():
    shape = lambda *dims, dtype=jnp.float32: jax.ShapeDtypeStruct(dims, dtype)
    arrays = (shape(4, 1, H, K), shape(4, 1, H, K), shape(4, 1, HV, V))
    pool = dict(g=shape(4, 1, HV, K), beta=shape(4, 1, HV), initial_state=shape(SLOTS, HV, K, V))
    indices = shape(4, dtype=jnp.int32)
    with gla_core.use(backend="tpu"):
        resolution = gla_core.explain("kda", *arrays, **pool, ssm_state_indices=indices)
        assert resolution.winner.name == "decode"
        reasons = {c.implementation.name: c.reason for c in resolution.candidates}
        assert "ssm_state_indices" in reasons["chunk"] and "ssm_state_indices" in reasons["xla"]
        plain = gla_core.explain("kda", *arrays, g=pool["g"], beta=pool["beta"])
        assert "state pool" in {c.implementation.name: c.reason for c in plain.candidates}["decode"]
    assert gla_core.explain("kda", *arrays, **pool, ssm_state_indices=indices).winner.name == "decode_xla"


def test_bad_pool_arguments_are_named():
    arrays, _ = _inputs([1, 1])
    fixed = {name: x.reshape(2, 1, *x.shape[2:]) if x.shape[:2] == (1, 2) else x for name, x in arrays.items()}
    run = lambda **kw: fused_recurrent_kda(**{**fixed, **kw}, **OPTIONS)
    with pytest.raises(errors.ShapeError, match="ssm_state_indices"):
        run(ssm_state_indices=jnp.zeros((3,), jnp.int32))
    with pytest.raises(errors.InvalidArgumentError, match="P = 10"):
        run(ssm_state_indices=jnp.asarray([1, 10], jnp.int32))
    with pytest.raises(errors.InvalidArgumentError, match="one sequence"):
        run(ssm_state_indices=jnp.asarray([1, 1], jnp.int32))
    with pytest.raises(errors.InvalidArgumentError, match="num_accepted_tokens"):
        run(ssm_state_indices=jnp.asarray([1, 2], jnp.int32), num_accepted_tokens=jnp.ones((2,), jnp.int32))
    with pytest.raises(errors.InvalidArgumentError, match="num_accepted_tokens"):
        run(ssm_state_indices=jnp.asarray([[1], [2]], jnp.int32), num_accepted_tokens=jnp.asarray([1, 2], jnp.int32))
    with pytest.raises(errors.InvalidArgumentError, match="inplace_final_state"):
        run(inplace_final_state=False)
    with pytest.raises(errors.InvalidArgumentError, match="initial_state"):
        run(initial_state=None, ssm_state_indices=jnp.asarray([1, 2], jnp.int32))
    packed, cu = _inputs([1, 1])
    with pytest.raises(errors.InvalidArgumentError, match="cu_seqlens_cpu"):  # traced boundaries, 1-D indices
        jax.jit(
            lambda cu: fused_recurrent_kda(
                **packed, ssm_state_indices=jnp.asarray([1, 2], jnp.int32), cu_seqlens=cu, **OPTIONS
            )
        )(jnp.asarray(cu))
