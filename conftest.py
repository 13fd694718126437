"""Workspace pytest configuration: which marked test layers run on this host."""

from __future__ import annotations

import importlib.util

import jax
import pytest


def _has_libtpu() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def pytest_collection_modifyitems(config, items):
    on_tpu = jax.default_backend() == "tpu"
    skip_compile = pytest.mark.skip(reason="needs jax[tpu] (libtpu) for compile-only TPU devices: nox -s tpu_compile")
    skip_tpu = pytest.mark.skip(reason="needs a TPU host: nox -s tpu_tests")
    for item in items:
        if "tpu_compile" in item.keywords and not _has_libtpu():
            item.add_marker(skip_compile)
        if "tpu" in item.keywords and not on_tpu:
            item.add_marker(skip_tpu)


@pytest.fixture
def interpret() -> bool:
    """Whether Pallas TPU kernels run in TPU interpret mode: everywhere except on a TPU host."""
    return jax.default_backend() != "tpu"
