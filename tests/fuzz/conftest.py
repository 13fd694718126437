"""Prints the fuzz profile and seed before the tests run, and what ran per implementation after them."""

from __future__ import annotations

from . import budget


def _has_fuzz_tests(session) -> bool:
    return any("test_fuzz.py" in item.nodeid for item in session.items)


def pytest_collection_finish(session):
    if _has_fuzz_tests(session):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        reporter.write_line(
            f"gla fuzz: profile {budget.profile_name()}, seed {budget.fuzz_seed()} "
            f"(replay: {budget.PROFILE_VARIABLE}={budget.profile_name()} {budget.SEED_VARIABLE}={budget.fuzz_seed()})"
        )


def pytest_terminal_summary(terminalreporter):
    if not budget.EXECUTED and not budget.DECLINED:
        return
    terminalreporter.section(
        f"gla fuzz: examples run (declined) per test, profile {budget.profile_name()}, seed {budget.fuzz_seed()}"
    )
    for test_id in sorted(budget.EXECUTED.keys() | budget.DECLINED.keys()):
        terminalreporter.write_line(f"{budget.EXECUTED[test_id]:6d} ({budget.DECLINED[test_id]:5d})  {test_id}")
