"""Hypothesis strategies drawing `Spec`s (and NaN positions) for one (op, implementation).

Features an implementation may decline as a whole (gate kinds, varlen, dtype, h0/ht, kda's in-kernel
gate, ...) are drawn only among the combinations that `gla_core.explain` says it accepts on a small
probe call, so a restricted implementation (e.g. one that takes only g_gamma) still gets its full
budget. Declines that depend on shapes are left to the test, which asks explain again per example.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

from hypothesis import strategies as st

import gla_core
from gla_core.ops import CHUNK_SIZES

from .specs import (
    GATE_STRENGTHS,
    IN_KERNEL_GATE_STRENGTHS,
    Poison,
    Spec,
    build_case,
    decline_reason,
    find_implementation,
)

DTYPES = ("float32", "bfloat16")
SIMPLE_GATES = ((), ("g",), ("g_gamma",), ("g", "g_gamma"))
LOWER_BOUNDS = (None, -5.0, -1.0)
MAX_RESETS = 3
MAX_SEED = 2**16


@dataclasses.dataclass(frozen=True)
class Limits:
    """Shape ranges of one kind of implementation.

    Attributes:
      max_batch, max_seq_len, max_heads: B in [0, max_batch], T in [0, max_seq_len], H in [1, max_heads].
      max_group: kda and kda_gate: HV / H in [1, max_group].
      max_dim, special_dims: K and V in [1, max_dim], with the listed sizes drawn more often.
      max_sequences: varlen: up to this many packed sequences.
      max_work: T is capped so that B * HV * T * K * V stays below this (the float64 oracle is a
        token-by-token scan over [B, HV, K, V] states).
    """

    max_batch: int
    max_seq_len: int
    max_heads: int
    max_group: int
    max_dim: int
    special_dims: tuple[int, ...]
    max_sequences: int
    max_work: int


# xla, recurrent: the ranges
NATIVE = Limits(
    max_batch=3,
    max_seq_len=300,
    max_heads=3,
    max_group=3,
    max_dim=300,
    special_dims=(1, 64, 128, 129, 256),
    max_sequences=6,
    max_work=2**24,
)
# Pallas kernels in TPU interpret mode: tiny shapes
INTERPRET = Limits(
    max_batch=2,
    max_seq_len=64,
    max_heads=2,
    max_group=2,
    max_dim=130,
    special_dims=(1, 64, 128, 129, 130),
    max_sequences=4,
    max_work=2**21,
)


def limits_for(implementation: gla_core.Implementation) -> Limits:
    return INTERPRET if implementation.interpretable else NATIVE


# --------------------------------------------------------------------------- features


_BOOLS = (False, True)
FEATURES = {
    "simple_gla": dict(
        gates=SIMPLE_GATES, varlen=_BOOLS, dtype=DTYPES, initial_state=_BOOLS, output_final_state=_BOOLS
    ),
    "gla": dict(varlen=_BOOLS, dtype=DTYPES, initial_state=_BOOLS, output_final_state=_BOOLS),
    "kda": dict(
        varlen=_BOOLS, dtype=DTYPES, initial_state=_BOOLS, output_final_state=_BOOLS, use_gate_in_kernel=_BOOLS
    ),
    "kda_gate": dict(dtype=DTYPES, dt_bias=_BOOLS, lower_bound=LOWER_BOUNDS),
}
PROBE_SHAPE = dict(batch=1, seq_len=4, num_heads=1, key_dim=8, value_dim=8, chunk_size=CHUNK_SIZES[0])
PROBE_CU_SEQLENS = (0, 1, 4)


def _probe(op: str, features: dict) -> Spec:
    features = dict(features)
    varlen = features.pop("varlen", False)
    return Spec(op, **PROBE_SHAPE, cu_seqlens=PROBE_CU_SEQLENS if varlen else None, **features)


def _probe_verdicts(op: str, implementation: gla_core.Implementation) -> list[tuple[dict, str | None]]:
    """(features, decline reason or None) for every combination of FEATURES[op], on a small probe call."""
    names = tuple(FEATURES[op])
    verdicts = []
    for values in itertools.product(*FEATURES[op].values()):
        features = dict(zip(names, values, strict=True))
        verdicts.append((features, decline_reason(build_case(_probe(op, features)), implementation)))
    return verdicts


@functools.cache
def accepted_features(op: str, name: str) -> tuple[tuple[tuple[str, object], ...], ...]:
    """Every combination of FEATURES[op] that implementation `name` accepts (as sorted item tuples)."""
    verdicts = _probe_verdicts(op, find_implementation(op, name))
    return tuple(tuple(features.items()) for features, reason in verdicts if reason is None)


def probe_reasons(op: str, implementation: gla_core.Implementation) -> set[str]:
    """Why `implementation` declines the probe calls (to say why a test has nothing to run)."""
    return {reason for _, reason in _probe_verdicts(op, implementation) if reason is not None}


# --------------------------------------------------------------------------- shapes


def _dims(limits: Limits) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from(limits.special_dims), st.integers(1, limits.max_dim))


def _lengths(chunk_size: int, max_len: int, minimum: int = 0) -> st.SearchStrategy[int]:
    """A sequence length in [minimum, max_len]: 0, 1, around multiples of the chunk, or anything."""
    around_chunks = [chunk_size - 1, chunk_size, chunk_size + 1, 2 * chunk_size + 1]
    notable = sorted({n for n in (0, 1, *around_chunks) if minimum <= n <= max_len})
    anything = st.integers(minimum, max_len)
    return st.one_of(st.sampled_from(notable), anything) if notable else anything


@st.composite
def _cu_seqlens(draw, chunk_size: int, max_len: int, max_sequences: int, nonempty: bool) -> tuple[int, ...]:
    """Boundaries of 1..max_sequences packed sequences (empty and length-1 ones included), total <= max_len."""
    lengths = draw(st.lists(_lengths(chunk_size, max_len), min_size=1, max_size=max_sequences))
    if nonempty and sum(lengths) == 0:
        lengths[-1] = 1
    boundaries = [0]
    for length in lengths:
        boundaries.append(min(boundaries[-1] + length, max_len))
    return tuple(boundaries)


@st.composite
def specs(draw, op: str, implementation: gla_core.Implementation, *, nonempty: bool = False) -> Spec:
    """A `Spec` for `implementation` within its limits; `nonempty` specs have at least one token."""
    limits = limits_for(implementation)
    features = dict(draw(st.sampled_from(accepted_features(op, implementation.name))))
    varlen = features.pop("varlen", False)
    grouped = op in ("kda", "kda_gate")
    fields = dict(
        batch=1 if varlen else draw(st.integers(1 if nonempty else 0, limits.max_batch)),
        num_heads=draw(st.integers(1, limits.max_heads)),
        key_dim=draw(_dims(limits)),
        chunk_size=draw(st.sampled_from(CHUNK_SIZES)),
        seed=draw(st.integers(0, MAX_SEED)),
    )
    if op != "kda_gate":
        fields["value_dim"] = draw(_dims(limits))
    num_value_heads = fields["num_heads"] * (draw(st.integers(1, limits.max_group)) if grouped else 1)
    if grouped:
        fields["num_value_heads"] = num_value_heads
    work = max(1, fields["batch"] * num_value_heads * fields["key_dim"] * fields.get("value_dim", 1))
    max_len = max(1, min(limits.max_seq_len, limits.max_work // work))
    if varlen:
        cu_seqlens = draw(_cu_seqlens(fields["chunk_size"], max_len, limits.max_sequences, nonempty))
        fields.update(cu_seqlens=cu_seqlens, seq_len=cu_seqlens[-1], traced_cu_seqlens=draw(st.booleans()))
    else:
        fields["seq_len"] = draw(_lengths(fields["chunk_size"], max_len, minimum=1 if nonempty else 0))
    if op == "kda":
        fields.update(
            # with K = 1 the normalized key is sign(k): its gradient is ~1e-6 of the cotangent and any float32
            # backward (1 - k^2 / (k^2 + eps)) loses it to cancellation, so nothing meaningful is compared
            use_qk_l2norm_in_kernel=fields["key_dim"] > 1 and draw(st.booleans()),
            use_beta_sigmoid_in_kernel=draw(st.booleans()),
        )
        if features["use_gate_in_kernel"]:
            fields.update(dt_bias=draw(st.booleans()), lower_bound=draw(st.sampled_from(LOWER_BOUNDS)))
    spec = Spec(op, **fields, **features)
    strengths = IN_KERNEL_GATE_STRENGTHS if spec.in_kernel_gate else GATE_STRENGTHS
    resets = draw(st.integers(0, MAX_RESETS)) if spec.step_gate is not None else 0
    return dataclasses.replace(spec, gate=draw(st.sampled_from(strengths)), resets=resets)


@st.composite
def poisons(draw, spec: Spec) -> Poison:
    """A NaN position in k or v of a nonempty `spec`."""
    tensor = draw(st.sampled_from(("k", "v")))
    heads = spec.num_heads if tensor == "k" else (spec.num_value_heads or spec.num_heads)
    return Poison(
        tensor=tensor,
        batch_row=draw(st.integers(0, spec.batch - 1)),
        step=draw(st.integers(0, spec.seq_len - 1)),
        head=draw(st.integers(0, heads - 1)),
        dim=draw(st.integers(0, (spec.key_dim if tensor == "k" else spec.value_dim) - 1)),
    )


def poisoned_specs(op: str, implementation: gla_core.Implementation) -> st.SearchStrategy[tuple[Spec, Poison]]:
    """A nonempty spec and a NaN position in it."""
    return specs(op, implementation, nonempty=True).flatmap(lambda spec: st.tuples(st.just(spec), poisons(spec)))
