"""Varlen properties of kda (`xla`, `recurrent`), the FLA-named functions and the registration."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
from gla_core import errors
from gla_kda import api, chunk_kda, fused_recurrent_kda
from gla_ref.testing import TOLERANCES, assert_close, make_case

pytestmark = pytest.mark.oracle

TOL = TOLERANCES["float32"]


def _padded_per_sequence(case, cu):
    """The packed sequences of `case` as a batch [N, T_max, ...], right-padded with inert steps.

    Padding has k = v = beta = 0 and g = 0, so it changes neither the state nor earlier outputs:
    one batched run equals N separate per-sequence runs.
    """
    lengths = np.diff(cu)
    longest = int(lengths.max())

    def split(x, fill=0.0):
        rows = [np.asarray(x[0, a:b]) for a, b in itertools.pairwise(cu)]
        out = np.full((len(rows), longest, *x.shape[2:]), fill, np.float32)
        for n, row in enumerate(rows):
            out[n, : len(row)] = row
        return jnp.asarray(out)

    arrays = {name: split(case.inputs[name]) for name in ("q", "k", "v", "g", "beta")}
    arrays["initial_state"] = case.inputs["initial_state"]
    return arrays, lengths


@pytest.mark.parametrize("impl", ["xla", "recurrent"])
def test_varlen_equals_per_sequence_runs(impl):
    cu = np.array([0, 5, 5, 45, 46, 83], np.int32)  # empty, unaligned, length-1 sequences
    case = make_case(
        "kda", seq_len=int(cu[-1]), cu_seqlens=list(cu), initial_state=True, output_final_state=True, chunk_size=16
    )
    run = jax.jit(lambda arrays: gla_core.dispatch("kda", impl=impl, output_final_state=True, chunk_size=16, **arrays))
    o, final = run({**case.inputs, "cu_seqlens": jnp.asarray(cu)})
    batched, lengths = _padded_per_sequence(case, cu)
    o_seq, final_seq = run(batched)
    for n, (start, length) in enumerate(zip(cu[:-1], lengths, strict=True)):
        assert_close(f"o[sequence {n}]", o[0, start : start + length], o_seq[n, :length], TOL.output)
    assert_close("final_state", final, final_seq, TOL.output)
    assert_close("final_state[empty]", final[1], case.inputs["initial_state"][1], 0.0)


@pytest.mark.parametrize("impl", ["xla", "recurrent"])
def test_no_recompile_when_only_boundaries_change(impl):
    case = make_case("kda", seq_len=90, cu_seqlens=[0, 30, 90], initial_state=True, output_final_state=True)
    static = {name: value for name, value in case.options.items() if name != "cu_seqlens"}

    def loss(arrays, cu_seqlens):
        o, final = gla_core.dispatch("kda", impl=impl, cu_seqlens=cu_seqlens, **arrays, **static)
        return jnp.sum(o * o) + jnp.sum(final)

    step = jax.jit(jax.value_and_grad(loss))
    values = []
    for boundaries in ([0, 30, 90], [0, 1, 90], [0, 90, 90], [0, 0, 90], [0, 77, 90]):
        value, grads = step(case.inputs, jnp.asarray(boundaries, jnp.int32))
        values.append(float(value))
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(grads))
    assert step._cache_size() == 1
    assert len(set(values)) == len(values)  # the boundaries really changed the result


def test_chunk_kda_uses_xla_on_cpu_and_recurrent_agrees():
    case = make_case("kda", seq_len=70, num_heads=1, num_value_heads=2, initial_state=True, seed=5)
    args = {k: case.inputs[k] for k in ("q", "k", "v", "g", "beta")}
    resolution = gla_core.explain("kda", *(args[k] for k in ("q", "k", "v")), g=args["g"], beta=args["beta"])
    assert resolution.winner.name == "xla"
    h0 = case.inputs["initial_state"]
    chunked = jax.jit(lambda a, h0: chunk_kda(**a, initial_state=h0, output_final_state=True))
    recurrent = jax.jit(lambda a, h0: fused_recurrent_kda(**a, initial_state=h0, output_final_state=True))
    (o, final), (o_rec, final_rec) = chunked(args, h0), recurrent(args, h0)
    assert_close("o", o, o_rec, TOL.output)
    assert_close("final_state", final, final_rec, TOL.output)
    o_none, final_none = jax.jit(lambda a: chunk_kda(**a))(args)
    assert final_none is None and o_none.dtype == args["v"].dtype


def test_chunk_kda_family_choice():
    """chunk_kda runs "chunk" when it accepts the call (here: TPU interpret mode), else "xla"."""
    shape = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.float32)
    arrays = (shape(1, 128, 2, 64), shape(1, 128, 2, 64), shape(1, 128, 4, 64))
    kwargs = dict(g=shape(1, 128, 4, 64), beta=shape(1, 128, 4))
    assert gla_core.explain("kda", *arrays, **kwargs, among=api.CHUNK_FAMILY).winner.name == "xla"
    registered = {i.name for i in gla_core.implementations("kda")}
    expected = "chunk" if "chunk" in registered else "xla"
    assert gla_core.explain("kda", *arrays, **kwargs, interpret=True, among=api.CHUNK_FAMILY).winner.name == expected


def test_chunk_kda_rejects_gate_options_without_in_kernel_gate():
    case = make_case("kda", seq_len=8)
    args = {k: case.inputs[k] for k in ("q", "k", "v", "g", "beta")}
    with pytest.raises(errors.InvalidArgumentError, match="A_log"):
        chunk_kda(**args, A_log=jnp.zeros((2,)))
    with pytest.raises(errors.InvalidArgumentError, match="lower_bound"):  # FLA's bound of g: negative
        chunk_kda(**args, lower_bound=1.0)
    with pytest.raises(errors.ShapeError, match="A_log"):
        chunk_kda(**args, use_gate_in_kernel=True, A_log=jnp.zeros((3,)))


def test_registered_implementations():
    impls = {i.name: i for i in gla_core.implementations("kda")}
    assert impls["xla"].priority == 50 and impls["xla"].backends == {"cpu", "gpu", "tpu"}
    assert impls["recurrent"].priority == 10 and impls["recurrent"].backends == {"cpu", "gpu", "tpu"}
