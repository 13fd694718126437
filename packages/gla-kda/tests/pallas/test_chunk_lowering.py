"""kda `chunk` lowers for TPU (`jax.export`, platforms=["tpu"]) at production shapes, forward and backward.

Shapes (bf16): B=1, T=8192, H=HV=32, K=V=128 and B=2, T=4096, H=HV=16, K=V=128; varlen packs
the batch into one row of 4 sequences with traced `cu_seqlens`. No TPU needed.
"""

from __future__ import annotations

import pytest

from gla_core.kit import export_for_tpu

pytestmark = pytest.mark.lowering

FORWARD_KERNELS = ("kda_intra", "kda_state")
BACKWARD_KERNELS = ("kda_intra", "kda_state", "kda_state_bwd", "kda_intra_bwd")


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("shape", ["B1_T8192_H32", "B2_T4096_H16"])
def test_forward_lowers(production, shape, varlen):
    exported = export_for_tpu(production["forward"], *production["structs"](shape, varlen))
    text = exported.mlir_module()
    for kernel in FORWARD_KERNELS:
        assert kernel in text, f"kernel {kernel} missing from the lowered forward"
    assert exported.platforms == ("tpu",)


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("shape", ["B1_T8192_H32", "B2_T4096_H16"])
def test_backward_lowers(production, shape, varlen):
    structs = production["structs"](shape, varlen, with_cotangent=True)
    exported = export_for_tpu(production["backward"], *structs)
    text = exported.mlir_module()
    for kernel in BACKWARD_KERNELS:
        assert kernel in text, f"kernel {kernel} missing from the lowered backward"
    assert exported.platforms == ("tpu",)
