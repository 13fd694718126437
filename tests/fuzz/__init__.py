"""Differential fuzzing of every registered implementation against the float64 oracle.

  specs.py             `Spec`: one example as plain values; its arrays (`build_case`), its call, the decline check
  strategies.py        hypothesis strategies drawing `Spec`s (and NaN positions) within shape limits
  properties.py        what must hold for one spec: matches the oracle; a NaN does not flow backwards in time
  budget.py            profiles (examples per implementation), the seed, and counts of what ran
  test_fuzz.py         the properties over drawn specs, per (op, implementation) from the registry
  test_regressions.py  every failure the fuzzer found, as a plain parametrized case

Budgets: `GLA_FUZZ_PROFILE=full|ci|dev` (see budget.py); the seed is `GLA_FUZZ_SEED` or derived from
the git commit, printed at the start of the run.
"""
