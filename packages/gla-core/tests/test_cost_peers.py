"""gla_core.cost_peers: the other libraries' kernels the cost report compiles beside ours, at our shapes."""

from __future__ import annotations

import ast
import pathlib

import jax
import pytest

from gla_core.cost import attention_problem
from gla_core.cost_peers import PEER_REQUIREMENTS, build_peer, peer, peer_spec, peers_of
from gla_core.errors import InvalidArgumentError

NOXFILE = pathlib.Path(__file__).resolve().parents[3] / "noxfile.py"


def test_peers_stand_beside_kda_at_its_shape():
    assert [p.name for p in peers_of("kda")] == ["atomic_ops", "atomic_gdn2"] and peers_of("gla") == []
    spec = peer_spec("atomic_ops", attention_problem("kda", 2, 4096, 16).spec, "train")
    assert spec == {"program": "peer", "peer": "atomic_ops", "batch": 2, "seq_len": 4096, "heads": 16, "dim": 128,
                    "stage": "train"}  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="peer: expected one of"):
        peer("tops")


def _noxfile_constant(name: str):
    """The literal value of a top-level assignment in the noxfile (read, not run: running it again
    would register its sessions twice in this process)."""
    for node in ast.parse(NOXFILE.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"noxfile.py assigns no {name}")


def test_the_cost_session_installs_every_peer():
    assert set(PEER_REQUIREMENTS) == set(_noxfile_constant("COST_PEERS"))


@pytest.mark.parametrize("name", ["atomic_ops", "atomic_gdn2"])
def test_a_peers_training_step_takes_its_inputs_and_the_cotangents(name):
    pytest.importorskip(peer(name).module)
    fn, structs = build_peer(peer_spec(name, attention_problem("kda", 1, 256, 2).spec, "train"))
    layout = (1, 256, 2, 128) if peer(name).layout == "BTHK" else (1, 2, 256, 128)
    assert [s.shape for s in structs[:6]] == [layout] * 6 and structs[6].shape == (1, 2, 128, 128)
    (o, ht), gradients = jax.eval_shape(fn, *structs)  # q, k, v, w, b, g, h0, then d(o) and d(final state)
    assert (o.shape, ht.shape) == (structs[7].shape, structs[8].shape)
    assert [g.shape for g in gradients] == [s.shape for s in structs[:7]]
