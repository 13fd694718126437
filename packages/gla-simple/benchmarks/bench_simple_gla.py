"""CPU benchmarks of simple_gla and gla: every implementation that runs here, side by side.

Run with `nox -s bench` (or `pytest packages/gla-simple/benchmarks -o python_files='bench_*.py'
--benchmark-only --benchmark-group-by=group`). Shapes: B=1, T in {1024, 4096}, H=4, K=V=128,
float32, default chunk size 64; forward alone and forward+backward (the gradients of
sum(o * do) with respect to q, k, v and the gate). Each group compares the implementations
at one (op, pass, T); programs are compiled ahead of time, so rounds time execution only.

`test_xla_gemm_fraction` reports how close the `xla` simple_gla forward+backward comes to this
machine's matrix-multiply throughput (see `useful_flops` for the FLOP count it credits).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gla_core
from gla_ref import testing

BATCH, HEADS, KEY_DIM, VALUE_DIM, CHUNK = 1, 4, 128, 128, 64
SEQ_LENS = (1024, 4096)
PASSES = ("fwd", "fwd+bwd")
GEMM_SIZE = 2048


def cpu_implementations(op: str) -> list[str]:
    """Names of the registered implementations of `op` that run natively on CPU."""
    return [impl.name for impl in gla_core.implementations(op) if "cpu" in impl.backends]


def _gate_name(op: str) -> str:
    return "g" if op == "simple_gla" else "gk"


def _problem(op: str, seq_len: int):
    gates = dict(gates=("g",)) if op == "simple_gla" else {}
    case = testing.make_case(
        op, seq_len=seq_len, num_heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM, chunk_size=CHUNK, **gates
    )
    arrays = tuple(case.inputs[name] for name in ("q", "k", "v", _gate_name(op)))
    d_o = jnp.asarray(np.random.default_rng(1).standard_normal(case.inputs["v"].shape), jnp.float32)
    return arrays, d_o


def compiled_run(op: str, impl: str, mode: str, seq_len: int):
    """A no-argument callable running one compiled forward (or forward+backward) to completion."""
    arrays, d_o = _problem(op, seq_len)
    gate = _gate_name(op)

    def forward(q, k, v, g):
        o, _ = gla_core.dispatch(op, q, k, v, impl=impl, chunk_size=CHUNK, **{gate: g})
        return o

    if mode == "fwd":
        fn, args = forward, arrays
    else:

        def fn(q, k, v, g, d_o):
            return jax.grad(lambda *x: jnp.sum(forward(*x) * d_o), argnums=(0, 1, 2, 3))(q, k, v, g)

        args = (*arrays, d_o)
    compiled = jax.jit(fn).lower(*args).compile()
    return lambda: jax.block_until_ready(compiled(*args))


def _rounds(impl: str, seq_len: int) -> int:
    """Rounds per benchmark: the `reference` recurrence (gla-ref) needs tens of seconds for a
    forward+backward at T=4096 here, so it gets one round there."""
    if impl == "reference":
        return 1 if seq_len > 1024 else 2
    return 5 if impl == "xla" else 3


@pytest.mark.parametrize("seq_len", SEQ_LENS)
@pytest.mark.parametrize("mode", PASSES)
@pytest.mark.parametrize("op, impl", [(op, impl) for op in ("simple_gla", "gla") for impl in cpu_implementations(op)])
def test_implementation(benchmark, op, impl, mode, seq_len):
    benchmark.group = f"{op} {mode} T={seq_len}"
    benchmark.extra_info.update(op=op, impl=impl, mode=mode, T=seq_len, B=BATCH, H=HEADS, K=KEY_DIM, V=VALUE_DIM)
    run = compiled_run(op, impl, mode, seq_len)
    benchmark.pedantic(run, rounds=_rounds(impl, seq_len), iterations=1, warmup_rounds=0)


def useful_flops(seq_len: int, batch=BATCH, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM, chunk=CHUNK) -> int:
    """Matrix-multiply FLOPs of chunked simple_gla forward+backward, the work credited as useful.

    Per chunk of C steps and head, the forward does four GEMMs: kᵀv into the state contribution
    and q·h (2·C·K·V each), q·kᵀ and A·v (2·C²·K, 2·C²·V); the backward does eight of the same
    sizes (q̄ᵀdo, do·hᵀ, v·dhᵀ, k̄·dh, do·vᵀ, Aᵀdo, dA·k, dAᵀq). Per token that is
    2·(2·K·V + C·(K+V)) forward and twice that backward:

        useful = 6 · B · T · H · (2·K·V + C·(K + V))

    Not credited: the recomputation of the forward inside the backward, the state scans and
    every elementwise operation (decays, exponentials, layout). B=1, T=4096, H=4, K=V=128,
    C=64 gives 4.83 GFLOP.
    """
    return 6 * batch * seq_len * heads * (2 * key_dim * value_dim + chunk * (key_dim + value_dim))


def gemm_gflops(rounds: int = 5) -> float:
    """float32 GFLOP/s of a GEMM_SIZE² `jnp` matmul on this machine (best of `rounds`)."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((GEMM_SIZE, GEMM_SIZE)), jnp.float32)
    compiled = jax.jit(jnp.matmul).lower(a, a).compile()
    jax.block_until_ready(compiled(a, a))
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(compiled(a, a))
        best = min(best, time.perf_counter() - start)
    return 2 * GEMM_SIZE**3 / best / 1e9


def test_xla_gemm_fraction(benchmark, perf_report):
    """Useful GFLOP/s of xla simple_gla forward+backward (B=1, T=4096, H=4, K=V=128) / f32 GEMM GFLOP/s."""
    seq_len = 4096
    benchmark.group = "simple_gla xla fwd+bwd vs GEMM"
    run = compiled_run("simple_gla", "xla", "fwd+bwd", seq_len)
    gemm_before = gemm_gflops()
    benchmark.pedantic(run, rounds=7, iterations=1, warmup_rounds=1)
    gemm = max(gemm_before, gemm_gflops())
    seconds = benchmark.stats.stats.min
    useful = useful_flops(seq_len) / seconds / 1e9
    fraction = useful / gemm
    benchmark.extra_info.update(
        useful_gflop=useful_flops(seq_len) / 1e9,
        useful_gflops_per_s=useful,
        gemm_gflops_per_s=gemm,
        gemm_fraction=fraction,
        flop_formula="6*B*T*H*(2*K*V + C*(K+V))",
    )
    perf_report.append(
        f"xla simple_gla fwd+bwd B=1 T={seq_len} H={HEADS} K=V={KEY_DIM} C={CHUNK}: {seconds * 1e3:.0f} ms, "
        f"useful {useful:.1f} GFLOP/s (6*B*T*H*(2KV + C(K+V)) = {useful_flops(seq_len) / 1e9:.2f} GFLOP); "
        f"f32 GEMM {GEMM_SIZE}^2: {gemm:.1f} GFLOP/s; fraction {fraction:.2f} (target >= 0.4)"
    )
