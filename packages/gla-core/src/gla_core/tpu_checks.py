"""Checks that a function lowers and compiles for TPU from a host without one.

`export_for_tpu` runs `jax.export` for `platforms=["tpu"]` (needs nothing but jax);
`compile_for_tpu` compiles for a libtpu compile-only device (needs `jax[tpu]`) and reports,
for every Pallas (Mosaic) kernel, the scoped VMEM it reserved and its `pl.CostEstimate`, plus
XLA's temp memory for the whole program. Both take `jax.ShapeDtypeStruct`s, so production
shapes cost no host memory. Kernels are named by the innermost `jax.named_scope` around their
`pallas_call` (launchers wrap each call in one).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax

from gla_core.overrides import use
from gla_core.tpu import KERNEL_VMEM_BUDGET_BYTES  # noqa: F401 (re-exported for the kit)

TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2"}
# Mosaic's default scoped VMEM limit per chip: a kernel above it needs `vmem_limit_bytes`.
DEFAULT_SCOPED_VMEM_BYTES = {"v5e": 16 * 2**20, "v6e": 32 * 2**20}
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """One Mosaic kernel of a compiled program.

    Attributes:
      name: the innermost named scope around its pallas_call ("pallas_call" when none).
      scoped_vmem_bytes: scoped VMEM Mosaic reserved for it.
      flops, transcendentals, bytes_accessed: its `pl.CostEstimate` (None without one).
    """

    name: str
    scoped_vmem_bytes: int
    flops: int | None = None
    transcendentals: int | None = None
    bytes_accessed: int | None = None


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What the TPU compiler says about one compiled function.

    Attributes:
      chip: "v5e" or "v6e".
      temp_bytes: XLA's `memory_analysis().temp_size_in_bytes` (HBM scratch of the program).
      kernels: every Mosaic kernel, in program order.
    """

    chip: str
    temp_bytes: int
    kernels: tuple[KernelReport, ...]

    @property
    def scoped_vmem_bytes(self) -> tuple[int, ...]:
        """Scoped VMEM of each kernel, in program order."""
        return tuple(k.scoped_vmem_bytes for k in self.kernels)

    def summary(self) -> str:
        kib = ", ".join(f"{k.name} {k.scoped_vmem_bytes / 1024:.0f}" for k in self.kernels) or "none"
        return f"{self.chip}: temp {self.temp_bytes / 2**20:.1f} MiB, scoped VMEM per kernel [KiB]: {kib}"


def _kernel_name(line: str) -> str:
    match = _OP_NAME.search(line)
    if match is None:
        return "pallas_call"
    transforms = ("jit(", "jvp(", "transpose(", "vmap(", "checkpoint")
    scopes = [s for s in match.group(1).split("/") if s and s != "pallas_call" and not s.startswith(transforms)]
    return scopes[-1] if scopes else "pallas_call"


def _backend_config(line: str) -> dict:
    start = line.index("backend_config=") + len("backend_config=")
    config, _ = json.JSONDecoder().raw_decode(line[start:])
    return config


def is_mosaic_call(line: str) -> bool:
    """Whether a line of compiled HLO text is a Mosaic (Pallas TPU) custom call."""
    return 'custom_call_target="tpu_custom_call"' in line


def scoped_vmem_bytes(line: str) -> int:
    """The scoped memory a Mosaic custom call (one line of compiled HLO text) uses; 0 if it says none.

    XLA grants each op a scoped region (`scoped_memory_configs`: offset and size per memory
    space) and reports the op's use as a region from address 0 (`used_scoped_memory_configs`).
    When XLA keeps the bottom of VMEM for buffers of its own, the granted region starts above
    them (e.g. at 64 MiB), and only the used region's part from the granted offset on is the op's.
    """
    if "backend_config=" not in line:
        return 0
    config = _backend_config(line)
    granted_offset = {c.get("memory_space"): int(c.get("offset", 0)) for c in config.get("scoped_memory_configs", [])}
    used = 0
    for region in config.get("used_scoped_memory_configs", []):
        end = int(region.get("offset", 0)) + int(region.get("size", 0))
        used += max(0, end - granted_offset.get(region.get("memory_space"), 0))
    return used


def kernel_reports(hlo_text: str) -> tuple[KernelReport, ...]:
    """Every Mosaic custom call in compiled HLO text, with its scoped VMEM and cost estimate."""
    reports = []
    for line in hlo_text.splitlines():
        if not is_mosaic_call(line) or "backend_config=" not in line:
            continue
        config = _backend_config(line)
        scoped = scoped_vmem_bytes(line)
        cost = config.get("custom_call_config", {}).get("cost_estimate") or {}
        flops, transcendentals, bytes_accessed = (
            int(cost[key]) if key in cost else None for key in ("flops", "transcendentals", "bytes_accessed")
        )
        reports.append(KernelReport(_kernel_name(line), scoped, flops, transcendentals, bytes_accessed))
    return tuple(reports)


def export_for_tpu(fn: Callable[..., Any], *args: jax.ShapeDtypeStruct) -> jax.export.Exported:
    """Lowers `fn(*args)` for TPU with dispatch targeting the TPU backend."""
    with use(backend="tpu", interpret=False):
        return jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)


@functools.cache
def compile_only_device(chip: str):
    """The first device of a compile-only `TOPOLOGIES[chip]` topology (needs libtpu)."""
    from jax.experimental import topologies

    if chip not in TOPOLOGIES:
        raise ValueError(f"chip: expected one of {sorted(TOPOLOGIES)}, got {chip!r}")
    return topologies.get_topology_desc(TOPOLOGIES[chip], "tpu").devices[0]


def compile_for_tpu(
    fn: Callable[..., Any],
    args: Sequence[jax.ShapeDtypeStruct],
    chip: str = "v6e",
    donate_argnums: tuple[int, ...] = (),
) -> CompileReport:
    """Compiles `fn(*args)` for a compile-only TPU device of `chip` and reports memory use.

    `donate_argnums`: arguments whose buffers the program may reuse (e.g. a state pool updated in place).
    """
    device = compile_only_device(chip)
    sharding = jax.sharding.SingleDeviceSharding(device)
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    with use(backend="tpu", interpret=False, chip=chip):
        compiled = jax.jit(fn, donate_argnums=donate_argnums).lower(*placed).compile()
    memory = compiled.memory_analysis()
    return CompileReport(chip, int(memory.temp_size_in_bytes), kernel_reports(compiled.as_text()))
