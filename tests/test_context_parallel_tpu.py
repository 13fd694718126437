"""The context-parallel training step with the Pallas implementations compiles for a compile-only
v6e:2x2 topology (4 chips, T sharded over all of them), and its collectives are what the exchange
says: an all-gather of every shard's leaving state and transition (or P - 1 collective-permutes of
one state for the ring) forward, their transposes backward. Prints every collective with the bytes
each chip receives (`nox -s tpu_compile` runs pytest with -s); docs/perf/context-parallel.md has the
same at production shapes.
"""

from __future__ import annotations

import numpy as np
import pytest

CHIPS = 4
BATCH, HEADS, DIM = 1, 2, 128  # small: the collectives' shapes scale with B * H, compile time does not
SEQ_LEN = 1024  # global; 256 tokens per chip
PACKED = (0, 100, 300, 300, 700, 1024)

# (op, exchange, packed): every op with the default exchange, the ring, packed sequences
CASES = [
    ("simple_gla", "all_gather", False),
    ("simple_gla", "all_gather", True),
    ("gla", "all_gather", False),
    ("kda", "all_gather", False),
    ("kda", "ring", False),
]
MAP_ELEMENTS = {"simple_gla": 1, "gla": DIM, "kda": DIM * DIM}


def _training_step_hlo(op: str, exchange: str, packed: bool) -> str:
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import gla_core

    devices = topologies.get_topology_desc("v6e:2x2", "tpu").devices
    mesh = Mesh(np.array(devices), ("cp",))
    tokens = P(None, "cp")

    def struct(shape, dtype, spec=tokens):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    b, t, h, d = BATCH, SEQ_LEN, HEADS, DIM
    num_states = len(PACKED) - 1 if packed else b
    arrays = {name: struct((b, t, h, d), jnp.bfloat16) for name in ("q", "k", "v")}
    arrays["initial_state"] = struct((num_states, h, d, d), jnp.float32, P())
    if op == "simple_gla":
        arrays["g"] = struct((b, t, h), jnp.float32)
    elif op == "gla":
        arrays["gk"] = struct((b, t, h, d), jnp.float32)
    else:
        arrays.update(g=struct((b, t, h, d), jnp.float32), beta=struct((b, t, h), jnp.float32))
    cu_seqlens = jnp.asarray(PACKED, jnp.int32) if packed else None

    def step(arrays, do):
        def loss(arrays):
            arrays = dict(arrays)
            q, k, v = arrays.pop("q"), arrays.pop("k"), arrays.pop("v")
            o, ht = gla_core.dispatch_sharded(
                op,
                q,
                k,
                v,
                mesh=mesh,
                context_axis="cp",
                context_exchange=exchange,
                cu_seqlens=cu_seqlens,
                output_final_state=True,
                **arrays,
            )
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)) + jnp.sum(ht * ht)

        return jax.grad(loss)(arrays)

    with gla_core.use(backend="tpu", interpret=False):
        compiled = jax.jit(step).lower(arrays, struct((b, t, h, d), jnp.bfloat16)).compile()
    return compiled.as_text()


@pytest.mark.tpu_compile
@pytest.mark.parametrize(("op", "exchange", "packed"), CASES)
def test_training_step_collectives(op, exchange, packed):
    from gla_core.context_parallel.collectives import collectives
    from gla_core.context_parallel.exchange import exchanged_elements
    from gla_core.tpu_checks import kernel_reports

    text = _training_step_hlo(op, exchange, packed)
    kernels = sorted({k.name for k in kernel_reports(text)})
    found = collectives(text)
    label = f"{op} {exchange}{' packed' if packed else ''}, B={BATCH} T={SEQ_LEN} H={HEADS} K=V={DIM}, {CHIPS} chips"
    print(f"\n{label}: Pallas kernels {kernels}")
    for collective in found:
        print(f"  {collective.name}: {collective.describe()}")
    assert kernels, f"{label}: no Pallas kernel in the program"

    rows = 1 if packed else BATCH
    expected = exchanged_elements(exchange, CHIPS, rows, HEADS, DIM, DIM, MAP_ELEMENTS[op])
    forward = [c for c in found if c.backward is False]
    if exchange == "all_gather":
        gathered = [c for c in found if c.kind == "all-gather"]  # all forward
        received = sum(sum(np.prod(s) for _, s in c.arrays) * (CHIPS - 1) // CHIPS for c in gathered)
        states_only = exchanged_elements(exchange, CHIPS, rows, HEADS, DIM, DIM, 0)
        # XLA turns a tiny gather (simple_gla's P * B * H decays) into an all-reduce of a padded array
        assert states_only <= received <= expected, f"{label}: all-gathers bring {received} elements per chip"
        assert all(dtype == "f32" for c in gathered for dtype, _ in c.arrays), f"{label}: a state gathered narrowed"
        assert any(c.kind == "reduce-scatter" for c in found), f"{label}: no reduce-scatter for the gather's transpose"
    else:
        permutes = [c for c in forward if c.kind == "collective-permute"]
        assert len(permutes) == CHIPS - 1, [c.describe() for c in permutes]
        assert all(sum(np.prod(s) for _, s in c.arrays) == expected for c in permutes), label
        backward = [c for c in found if c.backward and c.kind == "collective-permute"]
        assert sorted(p[0] for c in backward for p in c.pairs) == list(range(1, CHIPS)), label
    if packed:  # the final states of sequences that end on different chips are summed over the axis
        assert any(c.kind == "all-reduce" and not c.backward for c in found), label
