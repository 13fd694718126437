"""The serving decode path of simple_gla and gla: `fused_recurrent_*` with a state pool.

`decode_xla` (CPU) against the float64 oracle `gla_ref.decode`: o, the written slots, every other
slot bit for bit. (The Pallas `decode` kernel's own tests are gla-core's tests/decode.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
from gla_ref import decode as reference
from gla_ref.testing import TOLERANCES, assert_close
from gla_simple import fused_recurrent_gla, fused_recurrent_simple_gla

pytestmark = pytest.mark.oracle

TOL = TOLERANCES["float32"]
H, K, V, SLOTS = 2, 16, 8, 7


def _arrays(batch, seq_len, seed=0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    decays = lambda *shape: jnp.asarray(-np.abs(rng.normal(0.3, 0.3, shape)), jnp.float32)
    return dict(
        q=normal(batch, seq_len, H, K),
        k=normal(batch, seq_len, H, K),
        v=normal(batch, seq_len, H, V),
        g=decays(batch, seq_len, H),
        gk=decays(batch, seq_len, H, K),
        initial_state=normal(SLOTS, H, K, V),
    )


def _check(o, pool, op, arrays, written, **pool_arguments):
    o_ref, pool_ref = reference.float64_oracle(op, {**arrays, **pool_arguments})
    assert_close("o", o, o_ref, TOL.output, label=f"{op} decode")
    assert_close("written slots", np.asarray(pool)[written], pool_ref[written], TOL.output, label=f"{op} decode")
    kept = [s for s in range(SLOTS) if s not in written]
    np.testing.assert_array_equal(np.asarray(pool)[kept], np.asarray(arrays["initial_state"])[kept])


def test_simple_gla_one_slot_per_sequence():
    arrays = _arrays(3, 1)
    del arrays["gk"]
    g_gamma = jnp.asarray([-0.1, -0.5], jnp.float32)
    indices = jnp.asarray([5, -1, 2], jnp.int32)
    step = jax.jit(
        lambda arrays, indices: fused_recurrent_simple_gla(**arrays, g_gamma=g_gamma, ssm_state_indices=indices)
    )
    o, pool = step(arrays, indices)
    _check(o, pool, "simple_gla", {**arrays, "g_gamma": g_gamma}, [5, 2], ssm_state_indices=indices)


def test_gla_slot_per_token_packed_and_no_gate():
    arrays = _arrays(1, 3)
    cu = np.asarray([0, 2, 3], np.int32)
    indices = jnp.asarray([[0, 1], [4, 6]], jnp.int32)
    accepted = jnp.asarray([1, 2], jnp.int32)
    pool_arguments = dict(ssm_state_indices=indices, num_accepted_tokens=accepted, cu_seqlens=jnp.asarray(cu))
    gla_arrays = {name: arrays[name] for name in ("q", "k", "v", "gk", "initial_state")}
    o, pool = fused_recurrent_gla(**gla_arrays, **pool_arguments)
    _check(o, pool, "gla", gla_arrays, [0, 1, 4], **pool_arguments)
    # gk=None: no decay, the simple_gla recurrence without a gate (as FLA's)
    plain = {name: arrays[name] for name in ("q", "k", "v", "initial_state")}
    o, pool = fused_recurrent_gla(**plain, **pool_arguments)
    _check(o, pool, "simple_gla", plain, [0, 1, 4], **pool_arguments)
    assert gla_core.explain("gla", **{**gla_arrays, **pool_arguments}).winner.name == "decode_xla"
