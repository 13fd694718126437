"""Prints the fuzz profile and seed before the tests run, and what ran per implementation after them
(under pytest-xdist, the root conftest prints the workers' counts)."""

from __future__ import annotations

from . import budget

WORKER_COUNTS_KEY = "gla_fuzz_counts"


def _has_fuzz_tests(session) -> bool:
    return any("test_fuzz.py" in item.nodeid for item in session.items)


def _replay_line() -> str:
    return (
        f"gla fuzz: profile {budget.profile_name()}, seed {budget.fuzz_seed()} "
        f"(replay: {budget.PROFILE_VARIABLE}={budget.profile_name()} {budget.SEED_VARIABLE}={budget.fuzz_seed()})"
    )


def pytest_collection_finish(session):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and _has_fuzz_tests(session):
        reporter.write_line(_replay_line())


def pytest_sessionfinish(session):
    """In a pytest-xdist worker: hands the counts to the controlling process (the root conftest
    merges and prints them; it does not load this file)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None and (budget.EXECUTED or budget.DECLINED):
        workeroutput[WORKER_COUNTS_KEY] = {
            "title": _title(),
            "replay": _replay_line(),
            "executed": dict(budget.EXECUTED),
            "declined": dict(budget.DECLINED),
        }


def _title() -> str:
    return f"gla fuzz: examples run (declined) per test, profile {budget.profile_name()}, seed {budget.fuzz_seed()}"


def pytest_terminal_summary(terminalreporter):
    if not budget.EXECUTED and not budget.DECLINED:
        return
    terminalreporter.section(_title())
    for test_id in sorted(budget.EXECUTED.keys() | budget.DECLINED.keys()):
        terminalreporter.write_line(f"{budget.EXECUTED[test_id]:6d} ({budget.DECLINED[test_id]:5d})  {test_id}")
    terminalreporter.write_line(_replay_line())
