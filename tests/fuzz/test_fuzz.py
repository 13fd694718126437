"""The properties over drawn specs, for every registered implementation except the oracle itself.

One test per (op, implementation) and property, with the budget of the active profile (budget.py).
Examples an implementation declines (`gla_core.explain`) are rejected and do not count.
"""

from __future__ import annotations

import pytest
from hypothesis import given, reject

import gla_core
from gla_ref import testing

from . import budget, properties, strategies
from .specs import build_case, decline_reason

ORACLE = "reference"


def _implementations(ops: tuple[str, ...]) -> list:
    params = []
    for op in ops:
        for implementation in gla_core.implementations(op):
            if implementation.name == ORACLE:
                continue
            marks = [pytest.mark.interpret] if implementation.interpretable else [pytest.mark.oracle]
            params.append(pytest.param(op, implementation, id=f"{op}-{implementation.name}", marks=marks))
    return params


def _require_accepted_features(op: str, implementation: gla_core.Implementation) -> None:
    if not strategies.accepted_features(op, implementation.name):
        reasons = "; ".join(sorted(strategies.probe_reasons(op, implementation)))
        pytest.skip(f"{op} {implementation.name} declines every probe call here: {reasons}")


def _accepts(case: testing.Case, implementation: gla_core.Implementation, test_id: str) -> bool:
    """Counts the example as run or declined."""
    if decline_reason(case, implementation) is not None:
        budget.DECLINED[test_id] += 1
        return False
    budget.EXECUTED[test_id] += 1
    return True


@pytest.mark.parametrize("op, implementation", _implementations(testing.OPS))
def test_matches_oracle(op, implementation):
    _require_accepted_features(op, implementation)
    test_id = f"oracle {op}-{implementation.name}"

    @budget.fuzzing("oracle", test_id, implementation.interpretable)
    @given(spec=strategies.specs(op, implementation))
    def fuzz(spec):
        if not _accepts(build_case(spec), implementation, test_id):
            reject()
        properties.check_matches_oracle(spec, implementation)

    fuzz()


@pytest.mark.parametrize("op, implementation", _implementations(testing.ATTENTION_OPS))
def test_nan_stays_causal(op, implementation):
    _require_accepted_features(op, implementation)
    test_id = f"nan {op}-{implementation.name}"

    @budget.fuzzing("nan", test_id, implementation.interpretable)
    @given(spec_and_poison=strategies.poisoned_specs(op, implementation))
    def fuzz(spec_and_poison):
        spec, poison = spec_and_poison
        if not _accepts(build_case(spec), implementation, test_id):
            reject()
        properties.check_nan_stays_causal(spec, poison, implementation)

    fuzz()
