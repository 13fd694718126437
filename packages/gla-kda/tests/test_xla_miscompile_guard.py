"""No compiled kda/kda_gate program holds the XLA:CPU miscompile's pattern (see
`gla_ref.testing.dots_on_broadcast_scalars`): forward alone and forward + VJP, over layouts with
a single chunk, several chunks, grouped value heads, varlen, with and without initial state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import gla_core
from gla_ref import testing

CASES = {
    "one-chunk": dict(seq_len=16, num_heads=1, key_dim=32, value_dim=16, chunk_size=64),
    "chunks": dict(seq_len=99, num_heads=2, key_dim=40, value_dim=24, chunk_size=16),
    "grouped-gate-l2norm": dict(
        seq_len=70,
        num_heads=1,
        num_value_heads=2,
        key_dim=32,
        value_dim=8,
        chunk_size=32,
        use_gate_in_kernel=True,
        use_qk_l2norm_in_kernel=True,
        lower_bound=-5.0,
    ),
    "varlen": dict(seq_len=50, num_heads=2, key_dim=16, value_dim=16, chunk_size=16, cu_seqlens=[0, 7, 7, 50]),
}


@pytest.mark.parametrize("impl", ["xla", "recurrent"])
@pytest.mark.parametrize("name", CASES)
def test_no_dot_reads_a_broadcast_scalar(impl, name):
    for initial_state in (False, True):
        case = testing.make_case("kda", initial_state=initial_state, output_final_state=True, **CASES[name])
        arrays = {**case.inputs, "cu_seqlens": case.options["cu_seqlens"]}
        static = {n: x for n, x in case.options.items() if n != "cu_seqlens"}

        def forward(arrays, static=static):
            return gla_core.dispatch("kda", impl=impl, **arrays, **static)

        def training(arrays, forward=forward):
            differentiable = {n: x for n, x in arrays.items() if n != "cu_seqlens"}
            out, vjp = jax.vjp(lambda d: forward({**d, "cu_seqlens": arrays["cu_seqlens"]}), differentiable)
            return vjp(jax.tree.map(jnp.ones_like, out))

        for program in (forward, training):
            found = testing.dots_on_broadcast_scalars(jax.jit(program).lower(arrays).compile().as_text())
            assert not found, f"{case.label} {impl} {program.__name__}: {found}"
