"""`gla explain kda` builds every kda argument from its command-line options."""

from __future__ import annotations

import types

import jax.numpy as jnp

from gla_core import Implementation, cli, hookimpl
from gla_core.registry import Registry, reset_default_registry
from gla_kda import ops


def _kda_probe(seen: list):
    """A plugin defining op kda with one implementation that records the calls it is asked about."""
    plugin = types.ModuleType("kda_probe")
    plugin.gla_ops = hookimpl(lambda: [ops.KDA])
    plugin.gla_implementations = hookimpl(
        lambda: [
            Implementation(
                op="kda",
                name="probe",
                fn=lambda args: args.v,
                priority=1,
                backends={"cpu", "gpu", "tpu"},
                package="probe",
                supports=lambda call: seen.append(call),
            )
        ]
    )
    return plugin


def test_kda_explain_builds_every_kda_argument():
    seen = []
    registry = Registry()
    registry.register(_kda_probe(seen))
    reset_default_registry(registry)
    try:
        gate = ["--gate-in-kernel", "--dt-bias", "--lower-bound", "-5"]
        argv = ["explain", "kda", "-H", "2", "--value-heads", "4", *gate, "--l2norm", "--dtype", "float32"]
        assert cli.main(argv) == 0
    finally:
        reset_default_registry(None)
    (call,) = seen
    assert call.num_value_heads == 4 and call.dtype == str(jnp.dtype("float32"))
    assert call.option("use_gate_in_kernel") and call.option("has_dt_bias") and call.option("has_lower_bound")


def test_explain_reports_bad_kda_shapes_as_errors(capsys):
    assert cli.main(["explain", "kda", "-H", "4", "--value-heads", "6"]) == 2
    assert "ShapeError" in capsys.readouterr().err
