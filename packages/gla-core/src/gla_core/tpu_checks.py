"""Checks that a function lowers and compiles for TPU from a host without one.

`export_for_tpu` runs `jax.export` for `platforms=["tpu"]` (needs nothing but jax);
`compile_for_tpu` compiles for a libtpu compile-only device (needs `jax[tpu]`) and reports
the scoped VMEM Mosaic reserved for every Pallas kernel and XLA's temp memory. Both take
`jax.ShapeDtypeStruct`s, so production shapes cost no host memory.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax

from gla_core.overrides import use

TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2"}
_SCOPED_VMEM = re.compile(r'"used_scoped_memory_configs":\[(.*?)\]')
_SCOPED_SIZE = re.compile(r'"size":"(\d+)"')


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What the TPU compiler says about one compiled function.

    Attributes:
      chip: "v5e" or "v6e".
      temp_bytes: XLA's `memory_analysis().temp_size_in_bytes` (HBM scratch of the program).
      scoped_vmem_bytes: scoped VMEM reserved by each Mosaic kernel, in program order.
    """

    chip: str
    temp_bytes: int
    scoped_vmem_bytes: tuple[int, ...]

    def summary(self) -> str:
        kib = ", ".join(f"{b / 1024:.0f}" for b in self.scoped_vmem_bytes) or "none"
        return f"{self.chip}: temp {self.temp_bytes / 2**20:.1f} MiB, scoped VMEM per kernel [KiB]: {kib}"


def export_for_tpu(fn: Callable[..., Any], *args: jax.ShapeDtypeStruct) -> jax.export.Exported:
    """Lowers `fn(*args)` for TPU with dispatch targeting the TPU backend."""
    with use(backend="tpu", interpret=False):
        return jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)


@functools.cache
def _compile_only_device(chip: str):
    from jax.experimental import topologies

    if chip not in TOPOLOGIES:
        raise ValueError(f"chip: expected one of {sorted(TOPOLOGIES)}, got {chip!r}")
    return topologies.get_topology_desc(TOPOLOGIES[chip], "tpu").devices[0]


def scoped_vmem_bytes(hlo_text: str) -> tuple[int, ...]:
    """Scoped VMEM sizes of the Mosaic custom calls in compiled HLO text."""
    sizes = []
    kernels = (line for line in hlo_text.splitlines() if "tpu_custom_call" in line)
    for match in (m for line in kernels for m in _SCOPED_VMEM.finditer(line)):
        sizes.append(sum(int(s) for s in _SCOPED_SIZE.findall(match.group(1))))
    return tuple(sizes)


def compile_for_tpu(fn: Callable[..., Any], args: Sequence[jax.ShapeDtypeStruct], chip: str = "v6e") -> CompileReport:
    """Compiles `fn(*args)` for a compile-only TPU device of `chip` and reports memory use."""
    device = _compile_only_device(chip)
    sharding = jax.sharding.SingleDeviceSharding(device)
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    with use(backend="tpu", interpret=False):
        compiled = jax.jit(fn).lower(*placed).compile()
    memory = compiled.memory_analysis()
    return CompileReport(chip, int(memory.temp_size_in_bytes), scoped_vmem_bytes(compiled.as_text()))
