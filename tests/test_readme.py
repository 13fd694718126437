"""README.md is executable documentation: every Python snippet and every `gla` command in it runs.

Also: the implementation table matches the registry (`gla list`), every `nox -s NAME` it names is
a nox session, and options that need an extra fail before any work when it is missing.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import shlex

import pytest

import gla_core
from gla_core import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _python_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)


def _gla_commands() -> list[str]:
    return sorted({c for c in re.findall(r"`(gla [^`]*)`", README) if not c.startswith("gla-")})


@pytest.mark.parametrize("index", range(len(_python_snippets())))
def test_python_snippet_runs(index, capsys):
    exec(compile(_python_snippets()[index], f"README.md python snippet {index}", "exec"), {})


COMMANDS_NEEDING_LIBTPU = {"cost", "schedule", "tune"}


@pytest.mark.parametrize("command", _gla_commands())
def test_gla_command_runs(command, capsys):
    argv = shlex.split(command)[1:]
    if argv[0] in COMMANDS_NEEDING_LIBTPU and "--help" not in argv and importlib.util.find_spec("libtpu") is None:
        pytest.skip("needs jax[tpu] (libtpu): nox -s tpu_compile")
    try:
        status = cli.main(argv)
    except SystemExit as exit:  # --help
        status = exit.code
    assert status == 0, capsys.readouterr()


def test_implementation_table_matches_the_registry():
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)` \| ([\w-]+) \| (\d+) \| ([^|]+) \|", README, flags=re.MULTILINE)
    documented = {
        (op, name, package, int(priority), backends.strip()) for op, name, package, priority, backends in rows
    }
    registered = set()
    for impl in gla_core.implementations():
        backends = ", ".join(sorted(impl.backends)) + (" (+ TPU interpret mode)" if impl.interpretable else "")
        registered.add((impl.op, impl.name, impl.package, impl.priority, backends))
    assert documented == registered


def test_every_nox_session_named_exists():
    noxfile = (ROOT / "noxfile.py").read_text()
    sessions = set(re.findall(r"^def (\w+)\(session", noxfile, flags=re.MULTILINE))
    sessions |= {f"tests-{p}" for p in re.findall(r'"(gla-\w+)"', noxfile)}
    named = set(re.findall(r"nox -s ([\w-]+)", README))
    assert named and named <= sessions, named - sessions


def test_plot_without_matplotlib_fails_before_timing_anything(monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a)
    )
    import gla_core.bench

    monkeypatch.setattr(gla_core.bench, "run_bench", lambda **kwargs: pytest.fail("benchmark ran before the check"))
    assert cli.main(["bench", "--plot", "out.png"]) == 2
    assert "matplotlib" in capsys.readouterr().err
