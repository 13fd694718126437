"""FLA's options of the simple_gla / gla functions against the float64 oracle.

- `state_v_first`: the states are [N, H, V, K]; every implementation honours it (through
  `gla_core.kit.with_state_layout`), checked with outputs and every gradient.
- `reverse` (fused_recurrent_*): the recurrence on every sequence read backwards.
- `parallel_simple_gla(..., output_attentions=True)`: o and the attention matrix, with strong decays
  and a hard reset.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
from gla_ref import parallel
from gla_ref.testing import TOLERANCES, assert_close, check_against_oracle, make_case, oracle
from gla_simple import chunk_gla, fused_recurrent_simple_gla, parallel_simple_gla

pytestmark = pytest.mark.oracle


def _v_first(fn):
    """`fn` called with [N, H, V, K] states (`state_v_first=True`), seen from outside with [N, H, K, V] ones."""

    def run(initial_state=None, **kwargs):
        swap = lambda x: None if x is None else jnp.swapaxes(x, -1, -2)
        o, final_state = fn(initial_state=swap(initial_state), state_v_first=True, **kwargs)
        return o, swap(final_state)

    return run


STATE_V_FIRST_CASES = {
    "simple_gla xla varlen": (
        lambda **kw: gla_core.dispatch("simple_gla", impl="xla", **kw),
        dict(op="simple_gla", gates=("g", "g_gamma"), num_heads=1, cu_seqlens=[0, 13, 13, 40], chunk_size=16),
    ),
    "gla recurrent": (lambda **kw: gla_core.dispatch("gla", impl="recurrent", **kw), dict(op="gla", batch=2)),
    "chunk_gla": (lambda gk, **kw: chunk_gla(g=gk, **kw), dict(op="gla")),
}


@pytest.mark.parametrize("name", sorted(STATE_V_FIRST_CASES))
def test_state_v_first(name):
    fn, options = STATE_V_FIRST_CASES[name]
    case = make_case(
        seq_len=40, key_dim=16, value_dim=24, initial_state=True, output_final_state=True, **options
    )  # K != V: a missed transpose changes shapes
    check_against_oracle(_v_first(fn), dataclasses.replace(case, label=f"{case.label} state_v_first"))


def _reversed_case(case, cu):
    """`case` with the tokens of every sequence in reverse order (numpy, exact)."""
    order = np.concatenate([np.arange(b - 1, a - 1, -1) for a, b in itertools.pairwise(cu)])
    inputs = {n: (x[:, order] if n in ("q", "k", "v", "g") else x) for n, x in case.inputs.items()}
    return dataclasses.replace(case, inputs=inputs), order


def test_reverse_reads_every_sequence_backwards():
    cu = [0, 9, 10, 10, 30]
    case = make_case(
        "simple_gla", seq_len=30, num_heads=2, cu_seqlens=cu, initial_state=True, output_final_state=True, seed=4
    )
    backwards, order = _reversed_case(case, cu)
    expected = oracle(backwards).outputs
    run = lambda kw: fused_recurrent_simple_gla(**kw, reverse=True, output_final_state=True)
    o, final_state = jax.jit(run)({**case.inputs, "cu_seqlens": case.options["cu_seqlens"]})
    tolerance = TOLERANCES["float32"].output
    assert_close("o", np.asarray(o)[:, order], expected["o"], tolerance, label="fused_recurrent reverse")
    assert_close("final_state", final_state, expected["final_state"], tolerance, label="fused_recurrent reverse")


def test_parallel_simple_gla_outputs_and_attention_matrix():
    case = make_case("simple_gla", seq_len=70, num_heads=2, gate_scale=4.0, seed=5)
    g = case.inputs["g"].at[0, 33, 1].set(-jnp.inf)  # a hard reset
    case = dataclasses.replace(case, inputs={**case.inputs, "g": g}, label=f"{case.label} reset")

    def o_only(q, k, v, g, scale, cu_seqlens, output_final_state, chunk_size):  # o and its gradients
        return parallel_simple_gla(q, k, v, g, scale=scale, cu_seqlens=cu_seqlens)[0], None

    check_against_oracle(o_only, case)
    arrays = {n: case.inputs[n] for n in ("q", "k", "v", "g")}
    _, attention = jax.jit(lambda arrays: parallel_simple_gla(**arrays, output_attentions=True))(arrays)
    with jax.enable_x64(True):
        up = lambda x: jnp.asarray(np.asarray(x, np.float64))
        expected = np.asarray(parallel.simple_gla_attention(up(arrays["q"]), up(arrays["k"]), up(arrays["g"])))
    assert attention.shape == (1, 2, 70, 70) and attention.dtype == arrays["q"].dtype
    assert_close("attention", attention, expected, TOLERANCES["float32"].output, label=case.label)
    without_gate = parallel_simple_gla(arrays["q"], arrays["k"], arrays["v"], output_attentions=True)[1]
    with jax.enable_x64(True):
        expected = np.asarray(parallel.simple_gla_attention(up(arrays["q"]), up(arrays["k"])))
    assert_close("attention (no gate)", without_gate, expected, TOLERANCES["float32"].output, label="parallel")
    with pytest.raises(gla_core.errors.InvalidArgumentError, match="output_attentions"):
        parallel_simple_gla(**arrays, output_attentions=True, cu_seqlens=jnp.asarray([0, 70], jnp.int32))
