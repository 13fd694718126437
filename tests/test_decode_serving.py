"""The serving decode program (`gla_core.kit.decode.serving`) at production shapes, for TPU.

256 sequences, H = 16, K = V = 128, bf16 tokens, a float32 pool of 1024 slots: one token per
sequence (1-D `ssm_state_indices`), and speculative decoding with 4 tokens per sequence (2-D indices,
`num_accepted_tokens`) in the [V, K] state layout. Lowering (`jax.export` for TPU, no TPU needed):
the Pallas kernel is there and the pool is aliased to its output. Compiling (libtpu compile-only
v5e/v6e): with the pool donated the program allocates no copy of it, the kernel fits the chip's
default scoped VMEM, and the report prints the HBM floor the cost report compares with.
"""

from __future__ import annotations

import pytest

from gla_core.decode.serving import serving_problem
from gla_core.kit import DEFAULT_SCOPED_VMEM_BYTES, compile_for_tpu, export_for_tpu

PROBLEMS = {
    "simple_gla 1 token": lambda: serving_problem("simple_gla"),
    "gla 1 token": lambda: serving_problem("gla"),
    "kda 1 token": lambda: serving_problem("kda"),
    "kda 4 tokens state_v_first": lambda: serving_problem("kda", tokens_per_sequence=4, state_v_first=True),
}


@pytest.mark.lowering
@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_decode_lowers_for_tpu(name):
    problem = PROBLEMS[name]()
    text = export_for_tpu(problem.fn, *problem.structs).mlir_module()
    assert "gla_decode" in text and "tpu_custom_call" in text
    assert "output_operand_aliases" in text  # the kernel writes into the pool's buffer


@pytest.mark.tpu_compile
@pytest.mark.parametrize("chip", ["v5e", "v6e"])
@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_decode_compiles_in_place(name, chip):
    problem = PROBLEMS[name]()
    report = compile_for_tpu(problem.fn, problem.structs, chip=chip, donate_argnums=problem.donate_argnums)
    print(f"{problem.label}: {report.summary()}; HBM floor {problem.hbm_floor_bytes / 2**20:.0f} MiB")
    pool = problem.structs[problem.donate_argnums[0]]
    pool_bytes = pool.size * pool.dtype.itemsize
    assert report.temp_bytes < pool_bytes // 8, f"{chip}: {report.temp_bytes} temp bytes: the pool was copied"
    assert [k.name for k in report.kernels] == ["gla_decode"]
    assert report.kernels[0].scoped_vmem_bytes <= DEFAULT_SCOPED_VMEM_BYTES[chip]
