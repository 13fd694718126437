"""Runs the context-parallel tests (`tests/context_parallel`) on 8 fake CPU devices.

JAX fixes the number of CPU devices when its backend starts (`XLA_FLAGS=
--xla_force_host_platform_device_count=8`), and every other test of the suite runs on one device, so
the context-parallel tests get their own process: this test starts `pytest tests/context_parallel`
with the flag and fails with its report when any of them fails. Their own conftest collects them only
in such a process, so the suite's run does not see them twice. They hold oracle and interpret tests,
so this test carries both markers.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

SUITE = pathlib.Path(__file__).parent / "context_parallel"
# 8 fake devices share the host's cores: one thread per device, no intra-op thread pools.
FLAGS = "--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false"
TIMEOUT_SECONDS = 1200


@pytest.mark.oracle
@pytest.mark.interpret
def test_context_parallel_on_8_cpu_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FLAGS}".strip()
    env["JAX_PLATFORMS"] = "cpu"  # fake CPU devices; no TPU runtime probing in the child
    command = [sys.executable, "-m", "pytest", str(SUITE), "-q", "-p", "no:cacheprovider", "-rfE"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_SECONDS, check=False)
    report = result.stdout + result.stderr
    print(report)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{report[-20000:]}"
    assert " passed" in result.stdout, report
