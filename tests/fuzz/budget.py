"""How much the fuzzer runs, with which seed, and what it ran.

Profiles (environment variable GLA_FUZZ_PROFILE; when unset: "ci" if the variable CI is set, else "dev"):

  full  `nox -s fuzz`: 1000 examples per (op, natively running implementation: xla, recurrent) and
        100 per Pallas implementation in TPU interpret mode; failures are shrunk. Hours.
  ci    a fixed budget that finishes in under 10 minutes on 2 cores; no shrinking.
  dev   the default `pytest` run: a smaller budget; no shrinking.

The seed is GLA_FUZZ_SEED, else the first 8 hex digits of the current git commit (every commit fuzzes
new examples), else 0. conftest.py prints it with the profile at the start of the run; the same seed
and profile draw the same examples again (each test mixes its own name into the seed).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import pathlib
import subprocess
import zlib

from hypothesis import HealthCheck, Phase, seed, settings

PROFILE_VARIABLE = "GLA_FUZZ_PROFILE"
SEED_VARIABLE = "GLA_FUZZ_SEED"
REPOSITORY = pathlib.Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Budget:
    """Examples per (op, implementation) and property; Pallas implementations run in TPU interpret mode."""

    oracle: int
    oracle_interpret: int
    nan: int
    nan_interpret: int
    shrink: bool

    def examples(self, prop: str, interpret: bool) -> int:
        """The number of accepted examples for one (op, implementation) of property `prop` ("oracle", "nan")."""
        return getattr(self, f"{prop}_interpret" if interpret else prop)


BUDGETS = {
    "full": Budget(oracle=1000, oracle_interpret=100, nan=200, nan_interpret=20, shrink=True),
    "ci": Budget(oracle=10, oracle_interpret=3, nan=4, nan_interpret=2, shrink=False),
    "dev": Budget(oracle=4, oracle_interpret=2, nan=2, nan_interpret=2, shrink=False),
}
# Hypothesis tries the simplest example first (B = 0 or T = 0, K = V = 1): a budget of 1 would test nothing else.

for _name, _budget in BUDGETS.items():
    settings.register_profile(
        f"gla-fuzz-{_name}",
        max_examples=_budget.oracle,
        deadline=None,
        print_blob=True,
        derandomize=True,
        database=None,
        phases=tuple(Phase) if _budget.shrink else (Phase.explicit, Phase.reuse, Phase.generate),
        # every example compiles new programs (too_slow); implementations decline some drawn calls
        # (filter_too_much); large shapes draw many choices (data_too_large, large_base_example)
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.filter_too_much,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )


def profile_name() -> str:
    """The active profile: GLA_FUZZ_PROFILE, else "ci" under CI, else "dev"."""
    name = os.environ.get(PROFILE_VARIABLE) or ("ci" if os.environ.get("CI") else "dev")
    if name not in BUDGETS:
        raise ValueError(f"{PROFILE_VARIABLE}: expected one of {sorted(BUDGETS)}, got {name!r}")
    return name


@functools.cache
def fuzz_seed() -> int:
    """GLA_FUZZ_SEED, else the first 8 hex digits of the git commit checked out here, else 0."""
    if os.environ.get(SEED_VARIABLE):
        return int(os.environ[SEED_VARIABLE])
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPOSITORY, capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()
        return int(commit[:8], 16)
    except (OSError, subprocess.SubprocessError, ValueError):
        return 0


def fuzzing(prop: str, test_id: str, interpret: bool):
    """Decorator for a `@given` test: the active profile's settings and budget, seeded by the run seed and `test_id`."""
    budget = BUDGETS[profile_name()]
    profile = settings.get_profile(f"gla-fuzz-{profile_name()}")
    test_seed = zlib.crc32(f"{fuzz_seed()} {prop} {test_id}".encode())

    def decorate(test):
        return seed(test_seed)(settings(profile, max_examples=budget.examples(prop, interpret))(test))

    return decorate


# (property, test id) -> examples run / declined by the implementation, for the summary in conftest.py
EXECUTED: collections.Counter = collections.Counter()
DECLINED: collections.Counter = collections.Counter()
