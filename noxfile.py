"""Developer sessions. `nox -l` lists them; second runs reuse their virtualenvs.

tests              every package's tests and the cross-package tests (oracle, interpret, lowering layers)
tests-<package>    one package's tests, with only that package, its runtime dependencies and gla-ref installed
fuzz               the differential fuzzer (tests/fuzz) with its full budget: hours (GLA_FUZZ_SEED to replay)
lint               ruff check and ruff format --check
demo               `gla demo`: every op vs the float64 oracle on this backend
bench              pytest-benchmark: every implementation side by side (JSON in .benchmarks/)
tpu_compile        installs jax[tpu] and compiles kernels for compile-only v5e/v6e devices
cost               docs/perf/tpu-cost.md: libtpu's static time of every program vs its HBM floor, peers beside
tpu_tests          the oracle and kernel tests compiled (no interpret mode) on a TPU host
"""

from __future__ import annotations

import glob
import os
import pathlib
import re
import tomllib

import nox

nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "tests"]

ROOT = pathlib.Path(__file__).parent
PYTHON = "3.11"
# The exact JAX every session tests with; the packages declare the tested range (>=0.10.2,<0.11).
JAX = "jax==0.10.2"
JAX_TPU = "jax[tpu]==0.10.2"
JAXLIB = "jaxlib==0.10.2"
PACKAGES = ("gla-core", "gla-ref", "gla-simple", "gla-fused", "gla-kda")


def workspace_dependencies(package: str) -> tuple[str, ...]:
    """The workspace packages `package` needs at run time (its `dependencies`, transitively), itself included."""
    needed, pending = [], [package]
    while pending:
        name = pending.pop()
        if name in needed:
            continue
        needed.append(name)
        metadata = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())["project"]
        declared = [re.split(r"[=<>!~ \[;]", requirement, maxsplit=1)[0] for requirement in metadata["dependencies"]]
        pending.extend(dependency for dependency in declared if dependency in PACKAGES)
    return tuple(sorted(needed, key=PACKAGES.index))


# Each package with its runtime dependencies only, plus gla-ref (the oracle its tests compare with).
TEST_DEPENDENCIES = {
    package: tuple(sorted({*workspace_dependencies(package), "gla-ref"}, key=PACKAGES.index)) for package in PACKAGES
}
# nox too: tests/test_packaging.py reads this file's dependency sets.
# pytest-xdist: the test sessions run on every core (the tests are single-threaded: interpret mode
# and XLA:CPU compiles), each worker still running many shapes in one process.
TEST_TOOLS = ("pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "pytest-benchmark>=4", "nox")
# One pytest-xdist worker per core, at most 4 (memory: the largest tests take a few GB each).
PARALLEL = ("--numprocesses=auto", "--maxprocesses=4")


def install_packages(session: nox.Session, packages=PACKAGES, jax_requirement: str = JAX) -> None:
    """Installs the given workspace packages (editable) with the pinned JAX and the test tools."""
    editable = [arg for name in packages for arg in ("-e", str(ROOT / "packages" / name))]
    session.install(jax_requirement, JAXLIB, *TEST_TOOLS, *editable)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """All tests that run on this host (TPU-compile and TPU-host layers are skipped off their hosts)."""
    install_packages(session)
    session.run("pytest", *PARALLEL, *session.posargs)


for _package in PACKAGES:

    def _one_package(session: nox.Session, package: str = _package) -> None:
        """Installs only the package and what its tests need, then runs its tests."""
        install_packages(session, TEST_DEPENDENCIES[package])
        session.run("pytest", *PARALLEL, f"packages/{package}/tests", *session.posargs)

    _one_package.__doc__ = f"The tests of {_package} only."
    nox.session(python=PYTHON, name=f"tests-{_package}")(_one_package)


@nox.session(python=PYTHON)
def fuzz(session: nox.Session) -> None:
    """Every implementation vs the float64 oracle on hypothesis-drawn calls, full budget (tests/fuzz/budget.py)."""
    install_packages(session)
    session.run(
        "pytest",
        "tests/fuzz",
        "-p",
        "no:cacheprovider",
        *session.posargs,
        env={"GLA_FUZZ_PROFILE": "full", "TPU_SKIP_MDS_QUERY": "1"},
    )


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole workspace."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """Every installed op through dispatch on this backend, checked against the float64 oracle."""
    install_packages(session)
    session.run("gla", "demo", *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Every implementation side by side (pytest-benchmark); JSON saved under .benchmarks/."""
    install_packages(session)
    benchmarks = sorted(glob.glob("packages/*/benchmarks"))
    session.run(
        "pytest",
        *benchmarks,
        "-p",
        "no:cacheprovider",
        "-o",
        "python_files=bench_*.py",
        "--benchmark-only",
        "--benchmark-autosave",
        "--benchmark-group-by=group",
        "--benchmark-columns=min,median,mean,rounds",
        *session.posargs,
    )


@nox.session(python=PYTHON)
def tpu_compile(session: nox.Session) -> None:
    """Lowers and compiles every kernel for compile-only v5e/v6e devices (installs jax[tpu])."""
    install_packages(session, jax_requirement=JAX_TPU)
    # Compile-only devices never claim a TPU, so another libtpu process on the host (gla cost's
    # compile jobs) must not make every compile fail on libtpu's single-process lockfile.
    env = {"TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    session.run("pytest", "-m", "tpu_compile", "-s", *session.posargs, env=env)


# The peers the cost report compiles beside our kernels (gla_core.cost_peers.PEER_REQUIREMENTS); only
# the cost session installs them, no package depends on them.
COST_PEERS = ("atomic-ops==0.2.0",)


@nox.session(python=PYTHON)
def cost(session: nox.Session) -> None:
    """Writes docs/perf/tpu-cost.md: libtpu's static time of every program against its HBM floor, with the
    peers beside ours (installs jax[tpu] and the peers). About 30 minutes and up to 12 GB."""
    install_packages(session, jax_requirement=JAX_TPU)
    session.install(*COST_PEERS, JAX_TPU)
    arguments = session.posargs or ["--output", "docs/perf/tpu-cost.md"]
    session.run("gla", "cost", *arguments, env={"TPU_SKIP_MDS_QUERY": "1"})


def _on_tpu_host() -> bool:
    return bool(glob.glob("/dev/accel*")) or (os.path.isdir("/dev/vfio") and bool(os.listdir("/dev/vfio")))


@nox.session(python=PYTHON)
def tpu_tests(session: nox.Session) -> None:
    """Oracle and kernel tests compiled for the real TPU (no interpret mode). Needs a TPU host."""
    if not _on_tpu_host():
        session.error(
            "tpu_tests needs a TPU host (no /dev/accel* or /dev/vfio TPU device here). "
            "On this machine run `nox -s tests` (kernels in TPU interpret mode) and `nox -s tpu_compile`."
        )
    install_packages(session, jax_requirement=JAX_TPU)
    session.run("pytest", "-m", "oracle or interpret", *session.posargs)
