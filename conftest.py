"""Workspace pytest configuration: which marked test layers run on this host."""

from __future__ import annotations

import importlib.util

import jax
import pytest


def _has_libtpu() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def pytest_collection_modifyitems(config, items):
    skip_compile = pytest.mark.skip(reason="needs jax[tpu] (libtpu) for compile-only TPU devices: nox -s tpu_compile")
    for item in items:
        if "tpu_compile" in item.keywords and not _has_libtpu():
            item.add_marker(skip_compile)


MARGIN_REPORT_ROWS = 10


def pytest_terminal_summary(terminalreporter):
    """The measured errors that came closest to their bounds (gla_ref.testing records every check)."""
    try:
        from gla_ref.testing import measured_errors
    except ImportError:  # a package's tests without gla-ref installed
        return
    measured = measured_errors()
    if not measured:
        return
    tightest = sorted(measured, key=lambda row: row[2] / row[3], reverse=True)[:MARGIN_REPORT_ROWS]
    terminalreporter.section(f"error margins: {len(measured)} checks, tightest first (error / bound)")
    for label, name, error, bound in tightest:
        terminalreporter.write_line(f"{error / bound:6.3f}  {name:<16} {error:.2e} <= {bound:.0e}  {label}")


@pytest.fixture
def interpret() -> bool:
    """Whether Pallas TPU kernels run in TPU interpret mode: everywhere except on a TPU host."""
    return jax.default_backend() != "tpu"


@pytest.fixture
def no_races(interpret):
    """Runs the test's interpreted kernels on two simulated cores and fails if any of them races.

    Off TPU only (on a TPU host the kernels run compiled and this checks nothing).
    """
    if not interpret:
        yield None
        return
    from gla_core.tpu import detect_races

    with detect_races() as report:
        yield report
    assert report.kernels_checked > 0, "no Pallas kernel ran in TPU interpret mode inside the test"
    assert not report.races_found, (
        f"{report.kernels_with_races} of {report.kernels_checked} interpreted kernel runs had a race "
        "(the kernels' own output above says where)"
    )
