"""Collects the context-parallel tests only in a process started with 8 CPU devices.

`tests/test_context_parallel.py` runs `pytest tests/context_parallel` in a subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`: the device count is fixed when JAX's CPU
backend starts, and the rest of the suite keeps its single device. Run them alone with
`XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/context_parallel`.
"""

from __future__ import annotations

import os

import jax
import pytest

DEVICES = 8
FLAG = f"--xla_force_host_platform_device_count={DEVICES}"

if FLAG not in os.environ.get("XLA_FLAGS", ""):
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(autouse=True, scope="session")
def eight_cpu_devices():
    """Fails early (instead of with mesh errors) when JAX started before XLA_FLAGS was set."""
    count = jax.device_count()
    if count < DEVICES:
        pytest.fail(f"context-parallel tests need {DEVICES} CPU devices ({FLAG} before JAX starts), got {count}")
