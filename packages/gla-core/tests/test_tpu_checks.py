"""gla_core.tpu_checks on a tiny Pallas kernel: export for TPU, compile-only compile, report parsing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

import gla_core
from gla_core.tpu_checks import compile_for_tpu, export_for_tpu, scoped_vmem_bytes

ROWS, LANES, BLOCK = 1024, 128, 256


def _double_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2  # [BLOCK, LANES]


def _row_block(i):
    return i, 0


def doubled_sine(x):
    with jax.named_scope("double"):
        y = pl.pallas_call(
            _double_kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(ROWS // BLOCK,),
            in_specs=[pl.BlockSpec((BLOCK, LANES), _row_block)],
            out_specs=pl.BlockSpec((BLOCK, LANES), _row_block),
            cost_estimate=pl.CostEstimate(flops=ROWS * LANES, transcendentals=0, bytes_accessed=2 * ROWS * LANES * 4),
        )(x)
    return jnp.sin(y) @ y.T


STRUCT = jax.ShapeDtypeStruct((ROWS, LANES), jnp.float32)


@pytest.mark.lowering
def test_export_for_tpu_targets_the_tpu_backend():
    seen = []

    def probe(x):
        seen.append(gla_core.backend())
        return doubled_sine(x)

    exported = export_for_tpu(probe, STRUCT)
    assert exported.platforms == ("tpu",) and seen == ["tpu"]
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.tpu_compile
@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_compile_for_tpu_reports_each_kernel(chip):
    report = compile_for_tpu(doubled_sine, [STRUCT], chip=chip)
    (kernel,) = report.kernels
    assert kernel.name == "double"
    assert kernel.flops == ROWS * LANES and kernel.bytes_accessed == 2 * ROWS * LANES * 4
    assert kernel.scoped_vmem_bytes > 0 and report.scoped_vmem_bytes == (kernel.scoped_vmem_bytes,)
    assert report.temp_bytes >= 0
    print(report.summary())


def _mosaic_line(granted, used):
    """A compiled Mosaic call's HLO line with scoped-memory configs [(memory space, offset, size)]."""

    def regions(configs):
        return ",".join(f'{{"memory_space":"{m}","offset":"{o}","size":"{s}"}}' for m, o, s in configs)

    config = f'{{"scoped_memory_configs":[{regions(granted)}],"used_scoped_memory_configs":[{regions(used)}]}}'
    return f'%k = f32[8]{{0}} custom-call(%a), custom_call_target="tpu_custom_call", backend_config={config}'


@pytest.mark.parametrize(
    ("granted", "used", "expected"),
    [
        ([("1", 0, 32 << 20)], [("1", 0, 17 << 20)], 17 << 20),
        # XLA keeps the bottom 64 MiB for its own buffers: the op's region starts there.
        ([("1", 64 << 20, 32 << 20)], [("1", 0, (64 + 17) << 20)], 17 << 20),
        ([], [("1", 0, 4096)], 4096),
    ],
    ids=["from_zero", "above_xla_buffers", "no_grant_recorded"],
)
def test_scoped_vmem_bytes_counts_from_the_granted_offset(granted, used, expected):
    assert scoped_vmem_bytes(_mosaic_line(granted, used)) == expected
