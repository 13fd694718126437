"""Benchmark fixtures: a report printed after the run (pytest's terminal summary)."""

from __future__ import annotations

import pytest

REPORT = pytest.StashKey[list]()


@pytest.fixture
def perf_report(request) -> list:
    """Lines a benchmark adds here are printed in a "gla-simple CPU efficiency" section at the end."""
    return request.config.stash.setdefault(REPORT, [])


def pytest_terminal_summary(terminalreporter, config):
    lines = config.stash.get(REPORT, [])
    if lines:
        terminalreporter.section("gla-simple CPU efficiency")
        for line in lines:
            terminalreporter.write_line(line)
