"""What must hold for one spec and one implementation (used by the fuzz tests and the regression cases).

- `check_matches_oracle`: outputs, final states and the gradients of every differentiable input agree
  with the float64 oracle (`gla_ref.testing.check_against_oracle`, the tolerance of the input dtype),
  and so do the outputs of the forward compiled alone (the program inference runs: XLA fuses it
  differently from the forward-and-backward program).
- `check_nan_stays_causal`: a NaN in k or v at step t of one sequence leaves every output that cannot
  depend on it (the earlier steps of that sequence, every other sequence, their final states) finite
  and identical to the clean run. Forward only: every gradient may legitimately see the NaN.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

import gla_core
from gla_ref import testing

from .specs import Poison, Spec, build_case, implementation_fn, poisoned


def _forward(fn, case: testing.Case) -> dict[str, np.ndarray]:
    """The outputs of `fn` on `case` from a jitted forward alone, keyed like the oracle's outputs."""
    result = jax.jit(lambda inputs: fn(**inputs, **case.options))(case.inputs)
    values = (result,) if case.op == "kda_gate" else result
    return {name: np.asarray(value, np.float64) for name, value in zip(case.output_names, values, strict=False)}


def check_matches_oracle(spec: Spec, implementation: gla_core.Implementation) -> None:
    """Raises AssertionError naming the tensors of `spec` off the oracle (or the implementation's error)."""
    case = build_case(spec)
    fn = implementation_fn(spec, implementation)
    testing.check_against_oracle(fn, case)
    forward_alone = dataclasses.replace(case, label=f"{case.label} forward alone")
    testing.check_values_against_oracle(_forward(fn, case), forward_alone)


def _poisoned_sequence(spec: Spec, poison: Poison) -> tuple[int, int, int]:
    """(index of the poisoned sequence or batch row, its first step, its end) in the `[B, T]` grid."""
    if spec.cu_seqlens is None:
        return poison.batch_row, 0, spec.seq_len
    bounds = spec.cu_seqlens
    sequence = next(n for n in range(len(bounds) - 1) if bounds[n] <= poison.step < bounds[n + 1])
    return sequence, bounds[sequence], bounds[sequence + 1]


def _first_difference(name: str, clean: np.ndarray, dirty: np.ndarray, positions: np.ndarray) -> str | None:
    """None when `dirty` is finite and equal to `clean` everywhere; else a line naming the first bad element."""
    bad = ~(np.isfinite(dirty) & (dirty == clean))
    if not bad.any():
        return None
    index = tuple(int(i) for i in np.argwhere(bad)[0])
    where = tuple(int(i) for i in positions[index[0]]) + index[1:]
    values = f"{dirty[index]:.6g} with the NaN, {clean[index]:.6g} without"
    return f"{name}{list(where)}: {values} ({int(bad.sum())} bad elements)"


def check_nan_stays_causal(spec: Spec, poison: Poison, implementation: gla_core.Implementation) -> None:
    """Raises AssertionError when the NaN of `poison` reaches an output that does not depend on it."""
    case = build_case(spec)
    fn = implementation_fn(spec, implementation)
    clean, dirty = _forward(fn, case), _forward(fn, poisoned(case, poison))
    clean_o, dirty_o = clean["o"], dirty["o"]
    clean_state, dirty_state = clean.get("final_state"), dirty.get("final_state")

    sequence, start, end = _poisoned_sequence(spec, poison)
    independent = np.ones(clean_o.shape[:2], bool)  # [B, T]
    independent[poison.batch_row, poison.step : end] = False
    positions = np.argwhere(independent)
    failures = [_first_difference("o", clean_o[independent], dirty_o[independent], positions)]
    if clean_state is not None:
        others = np.array([n for n in range(clean_state.shape[0]) if n != sequence], dtype=int)
        failures.append(
            _first_difference("final_state", clean_state[others], dirty_state[others], others.reshape(-1, 1))
        )
    failures = [line for line in failures if line is not None]
    if failures:
        raise AssertionError(
            f"{case.label} nan in {poison.tensor}{[poison.batch_row, poison.step, poison.head, poison.dim]}: "
            f"outputs that do not depend on it changed (sequence {sequence} spans steps [{start}, {end}))\n  "
            + "\n  ".join(failures)
        )
