"""Other libraries' Pallas TPU kernels of the same ops, compiled beside ours in the TPU cost report.

A peer is a package from the package registry with a public JAX function for one of our ops (or a
generalization of it). `gla cost` compiles its forward and training step at the shapes of our
problem, with the same method (`gla_core.cost_measure`), through the peer's public API only. The
peers install in the `cost` nox session only (`PEER_REQUIREMENTS`), never as dependencies of gla.

- atomic-ops 0.2.0 (`atomic_ops` and, in the same distribution, `atomic_gdn2`): Gated DeltaNet-2
  kernels for TPU. GDN-2 updates `S = diag(exp g) S; S += k (w*v - (b*k)^T S)^T` with per-channel
  `w`, `b` and `g` (all [B, T, H, K]); KDA is the case `w = b = beta` (broadcast over channels),
  so its problem is KDA's with two per-channel float32 tensors instead of `beta [B, T, H]`.
  `atomic_ops` takes [B, T, H, K] like us, `atomic_gdn2` head-major [B, H, T, K]; its forward
  is compiled in that layout as given (a caller holding [B, T, H, K] tensors would transpose).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable

import jax
import jax.numpy as jnp

from gla_core.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class Peer:
    """One peer implementation.

    Attributes:
      name: how the report names it.
      module: the module to import (its presence decides whether the peer is measured).
      requirement: the registry requirement that installs it.
      op: our op whose rows it stands beside.
      api: the public function called.
      layout: "BTHK" (like ours) or "BHTK" (head-major).
      note: how its problem differs from ours, in one sentence.
    """

    name: str
    module: str
    requirement: str
    op: str
    api: str
    layout: str
    note: str

    def installed(self) -> bool:
        return importlib.util.find_spec(self.module) is not None


_GDN2_NOTE = (
    "Gated DeltaNet-2: KDA with per-channel `w`, `b` [B,T,H,K] float32 in place of `beta` [B,T,H] "
    "(more bytes in, so its own floor)"
)
PEERS = (
    Peer(
        "atomic_ops",
        "atomic_ops",
        "atomic-ops==0.2.0",
        "kda",
        "atomic_ops.gdn2_pallas_forward_trainable",
        "BTHK",
        _GDN2_NOTE,
    ),
    Peer(
        "atomic_gdn2",
        "atomic_gdn2",
        "atomic-ops==0.2.0",
        "kda",
        "atomic_gdn2.make_blr_trainable(make_cfg(interpret=False), scale)",
        "BHTK",
        _GDN2_NOTE + "; head-major layout",
    ),
)
PEER_OPS = tuple(sorted({peer.op for peer in PEERS}))
PEER_REQUIREMENTS = tuple(sorted({peer.requirement for peer in PEERS}))
# Peers that were looked for and are not in this table, and why (rendered in the report).
NOT_PEERS = (
    (
        "tokamax 0.0.12",
        "the latest release on the package registry has no gated linear attention, gated delta rule or KDA "
        "kernel (its ops: dot_product_attention, splash attention, gated_linear_unit (the GLU MLP, not GLA), "
        "layer_norm, ragged_dot, triangle_multiplication, linear_softmax_cross_entropy_loss)",
    ),
    ("tops", "not on the package registry; its figures in the issue are not reproduced here"),
)


def peer(name: str) -> Peer:
    for candidate in PEERS:
        if candidate.name == name:
            return candidate
    raise InvalidArgumentError(f"peer: expected one of {[p.name for p in PEERS]}, got {name!r}")


def peers_of(op: str) -> list[Peer]:
    """The peers that stand beside `op`."""
    return [p for p in PEERS if p.op == op]


def _gdn2_inputs(layout: str, b: int, t: int, h: int, d: int) -> list[jax.ShapeDtypeStruct]:
    """q, k, v (bf16), w, b, g (float32) and h0 (float32 [B, H, K, V])."""
    shape = (b, t, h, d) if layout == "BTHK" else (b, h, t, d)
    tokens = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for _ in range(3)]
    gates = [jax.ShapeDtypeStruct(shape, jnp.float32) for _ in range(3)]
    return [*tokens, *gates, jax.ShapeDtypeStruct((b, h, d, d), jnp.float32)]


def _gdn2_forward(name: str, d: int) -> Callable:
    """fn(q, k, v, w, b, g, h0) -> (o, final state) through the peer's public API."""
    scale = d**-0.5
    if name == "atomic_ops":
        import atomic_ops

        return lambda q, k, v, w, b, g, h0: atomic_ops.gdn2_pallas_forward_trainable(q, k, v, w, b, g, scale, h0=h0)
    import atomic_gdn2

    return atomic_gdn2.make_blr_trainable(atomic_gdn2.make_cfg(interpret=False), scale)


def build_peer(spec: dict):
    """`(fn, argument structs)` of a peer's forward or training step at our problem's shape.

    `spec`: {"program": "peer", "peer", "batch", "seq_len", "heads", "dim", "stage"}; the
    training step is `fn(*inputs, do, dht)`, the VJP of (o, final state) for every input.
    """
    chosen = peer(spec["peer"])
    structs = _gdn2_inputs(chosen.layout, spec["batch"], spec["seq_len"], spec["heads"], spec["dim"])
    forward = _gdn2_forward(chosen.name, spec["dim"])
    if spec["stage"] == "fwd":
        return forward, structs

    def step(*args):
        outputs, vjp = jax.vjp(forward, *args[:-2])
        return outputs, vjp(tuple(args[-2:]))

    cotangents = jax.eval_shape(forward, *structs)  # (o, final state): their shapes and dtypes
    return step, [*structs, *cotangents]


def peer_spec(name: str, problem_spec: dict, stage: str) -> dict:
    """The `build_program` spec of peer `name` at the shape of one of our problems (`Problem.spec`)."""
    shape = {key: problem_spec[key] for key in ("batch", "seq_len", "heads", "dim")}
    return {"program": "peer", "peer": name, **shape, "stage": stage}
