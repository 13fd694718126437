"""Workspace pytest configuration: which marked test layers run on this host."""

from __future__ import annotations

import collections
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
# Errors measured by pytest-xdist workers, sent to the controlling process when each worker ends.
WORKER_ERRORS_KEY = "gla_measured_errors"
_WORKER_ERRORS: list[tuple[str, str, float, float]] = []
# The fuzzer's examples per test from the workers (tests/fuzz/conftest.py, WORKER_COUNTS_KEY there).
WORKER_FUZZ_KEY = "gla_fuzz_counts"
_WORKER_FUZZ: dict = {}


def _measured_errors() -> list[tuple[str, str, float, float]]:
    try:
        from gla_ref.testing import measured_errors
    except ImportError:  # a package's tests without gla-ref installed
        return []
    return measured_errors()


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)  # set in a pytest-xdist worker
    if workeroutput is not None:
        workeroutput[WORKER_ERRORS_KEY] = [list(row) for row in _measured_errors()]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist: a worker ended; keep its measured errors and fuzz counts for the summaries."""
    output = getattr(node, "workeroutput", {})
    _WORKER_ERRORS.extend(tuple(row) for row in output.get(WORKER_ERRORS_KEY, ()))
    fuzz = output.get(WORKER_FUZZ_KEY)
    if fuzz:
        _WORKER_FUZZ.setdefault("title", fuzz["title"])
        _WORKER_FUZZ.setdefault("replay", fuzz["replay"])
        for kind in ("executed", "declined"):
            _WORKER_FUZZ.setdefault(kind, collections.Counter()).update(fuzz[kind])


def _print_worker_fuzz_counts(terminalreporter) -> None:
    if not _WORKER_FUZZ:
        return
    executed, declined = _WORKER_FUZZ["executed"], _WORKER_FUZZ["declined"]
    terminalreporter.section(_WORKER_FUZZ["title"])
    for test_id in sorted(executed.keys() | declined.keys()):
        terminalreporter.write_line(f"{executed[test_id]:6d} ({declined[test_id]:5d})  {test_id}")
    terminalreporter.write_line(_WORKER_FUZZ["replay"])


def pytest_terminal_summary(terminalreporter):
    """The measured errors that came closest to their bounds (gla_ref.testing records every check),
    over this process and every pytest-xdist worker (and the workers' fuzz counts)."""
    _print_worker_fuzz_counts(terminalreporter)
    measured = _measured_errors() + _WORKER_ERRORS
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
