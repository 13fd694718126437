"""The decode step with a state pool (`gla_core.decode.decode_attention`) against the float64 oracle.

Both implementations of the step — the Pallas kernel in TPU interpret mode (`interpret` layer) and
the XLA fallback (`oracle` layer) — on the same small problems, compared with `gla_ref.decode`:
`o`, every written pool slot (or the per-token states), and every other slot bit for bit. The cases
cover the scalar gate, the per-key gate and the delta rule; both state layouts; 1-D indices (a
slot per sequence, with a padding slot) and 2-D ones (a slot per token, num_accepted_tokens);
packed sequences of length 0, 1 and several, fixed-length batches; more than 8 tokens (two token
blocks); 16 value heads in groups; a bfloat16 pool; inplace_final_state=False.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_core.decode import decode_attention
from gla_ref.decode_cases import decode_problem, written_slots
from gla_ref.testing import TOLERANCES, assert_close

CASES = {
    "kda 1-D fixed padding-slot 16 heads in groups": lambda: decode_problem(
        "kda", lengths=(1, 1, 1), indices=[3, -1, 1], heads=4, value_heads=16, key_dim=8, value_dim=16, slots=5
    ),
    "kda 2-D accepted packed v_first": lambda: decode_problem(
        "kda",
        lengths=(3, 0, 1, 2),
        packed=True,
        indices=[[0, 1, 2], [3, 4, 5], [6, -1, 7], [8, 9, 10]],
        accepted=[2, 1, 3, 1],
        slots=12,
        v_first=True,
    ),
    "simple_gla 1-D packed bf16-pool": lambda: decode_problem(
        "simple_gla", lengths=(2, 0, 1), packed=True, pool_dtype=jnp.bfloat16, key_dim=32, value_dim=16
    ),
    "gla 1-D fixed 11 tokens": lambda: decode_problem("gla", lengths=(11, 11)),
    "kda 2-D token states": lambda: decode_problem(
        "kda", lengths=(2, 2), indices=[[1, 2], [3, -1]], accepted=[1, 2], inplace_final_state=False
    ),
}
# The XLA step also runs behind the decode_xla implementations (their tests in gla-simple, gla-kda).
XLA_CASES = ("kda 2-D accepted packed v_first", "simple_gla 1-D packed bf16-pool")
# The interpreted Pallas kernel is slow: the cases that together reach every path of the kernel.
PALLAS_CASES = (
    "kda 1-D fixed padding-slot 16 heads in groups",
    "kda 2-D accepted packed v_first",
    "simple_gla 1-D packed bf16-pool",
    "gla 1-D fixed 11 tokens",
    "kda 2-D token states",
)


def _check(problem, o, out):
    o_ref, out_ref = problem.oracle()
    tolerance = TOLERANCES["bfloat16" if problem.pool.dtype == jnp.bfloat16 else "float32"].output
    label = f"decode {problem.op}"
    finite = np.isfinite(o_ref).all(axis=(-1, -2))  # tokens with no slot are NaN in the oracle, not here
    assert_close("o", np.asarray(o)[finite], o_ref[finite], tolerance, label=label)
    if not problem.inplace_final_state:
        assert_close("token states", out, out_ref, tolerance, label=label)
        return
    written = sorted(written_slots(problem))
    assert_close("written slots", np.asarray(out)[written], out_ref[written], tolerance, label=label)
    kept = [s for s in range(problem.pool.shape[0]) if s not in written]
    np.testing.assert_array_equal(np.asarray(out)[kept], np.asarray(problem.pool)[kept])  # bit for bit


@pytest.mark.oracle
@pytest.mark.parametrize("name", XLA_CASES)
def test_xla_step(name):
    problem = CASES[name]()
    arguments = problem.arguments()
    static = {name: arguments.pop(name) for name in ("host_boundaries", "v_first", "inplace_final_state")}
    step = jax.jit(lambda *arrays, **arguments: decode_attention(*arrays, **arguments, **static, pallas=False))
    o, out = step(problem.q, problem.k, problem.v, problem.g, problem.beta, **arguments)
    _check(problem, o, out)


@pytest.mark.interpret
@pytest.mark.parametrize("name", PALLAS_CASES)
def test_pallas_step(name, interpret):
    problem = CASES[name]()
    arrays = (problem.q, problem.k, problem.v, problem.g, problem.beta)
    o, out = decode_attention(*arrays, **problem.arguments(), pallas=True, interpret=interpret)
    _check(problem, o, out)


@pytest.mark.interpret
def test_pallas_step_has_no_races(no_races):
    """Sequences write their own slots: two simulated cores running the parallel grid never race."""
    problem = decode_problem("kda", lengths=(1, 1), heads=1, key_dim=8, value_dim=8)
    o, out = decode_attention(
        problem.q, problem.k, problem.v, problem.g, problem.beta, **problem.arguments(), pallas=True, interpret=True
    )
    _check(problem, o, out)


def test_pallas_step_is_inference_only():
    problem = decode_problem("simple_gla", lengths=(1,), key_dim=8, value_dim=8)

    def loss(q):
        o, _ = decode_attention(q, problem.k, problem.v, problem.g, None, **problem.arguments(), pallas=True)
        return o.sum()

    with pytest.raises(ValueError, match="decode_xla"):
        jax.grad(loss)(problem.q)
