"""kda implementations that run on this backend, side by side (pytest-benchmark).

Shapes: B=1, T in {1024, 4096}, H=HV=4, K=V=128, float32, with the state in and out.
Forward and forward+backward (gradients of every input); compilation is excluded (one warm-up
call before timing). The `reference` token-by-token oracle runs only at the smaller T.

Run: `nox -s bench`, or
  python -m pytest packages/gla-kda/benchmarks -o python_files='bench_*.py' \
      --benchmark-only --benchmark-group-by=group
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import gla_core
from gla_ref.testing import make_case

BATCH, HEADS, DIM = 1, 4, 128
SEQ_LENS = (1024, 4096)
IMPLEMENTATIONS = ("xla", "recurrent", "reference")
REFERENCE_MAX_LEN = 1024


def _available(impl: str) -> bool:
    return any(i.name == impl and gla_core.backend() in i.backends for i in gla_core.implementations("kda"))


def _step(impl: str, case, mode: str):
    arrays = dict(case.inputs)
    static = {name: value for name, value in case.options.items() if name != "cu_seqlens"}

    def forward(arrays):
        return gla_core.dispatch("kda", impl=impl, **arrays, **static)

    if mode == "forward":
        return jax.jit(forward), arrays

    def loss(arrays):
        o, final = forward(arrays)
        return jnp.sum(o * o) + jnp.sum(final * final)

    return jax.jit(jax.grad(loss)), arrays


@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
@pytest.mark.parametrize("seq_len", SEQ_LENS)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_kda(benchmark, impl, seq_len, mode):
    if not _available(impl):
        pytest.skip(f"kda implementation {impl!r} does not run on backend {gla_core.backend()}")
    if impl == "reference" and seq_len > REFERENCE_MAX_LEN:
        pytest.skip(f"the token-by-token reference is only timed up to T={REFERENCE_MAX_LEN}")
    benchmark.group = f"kda {mode} B={BATCH} T={seq_len} H={HEADS} K=V={DIM} float32"
    case = make_case(
        "kda",
        batch=BATCH,
        seq_len=seq_len,
        num_heads=HEADS,
        key_dim=DIM,
        value_dim=DIM,
        initial_state=True,
        output_final_state=True,
    )
    fn, arrays = _step(impl, case, mode)
    jax.block_until_ready(fn(arrays))  # compile outside the timed rounds
    benchmark.pedantic(lambda: jax.block_until_ready(fn(arrays)), rounds=3, iterations=1, warmup_rounds=1)
