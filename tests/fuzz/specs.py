"""`Spec`: one fuzz example as plain values, and what is derived from it (arrays, the call, declines).

A spec names the shapes, the gates and their strength, varlen boundaries, flags and a data seed.
`build_case` turns it into a `gla_ref.testing.Case`: the arrays of `make_case`, then the gates of
the chosen strength with `-inf` resets. A spec printed by a failing hypothesis run can be pasted
as-is into test_regressions.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import gla_core
from gla_ref import testing

# Gate strengths for log decays given directly (simple_gla g and g_gamma, gla gk, kda g):
#   zero         exactly 0 (no decay at all)
#   weak         about WEAK_DECAY per step: states carry over thousands of steps
#   log_sigmoid  make_case's realistic decays, log_sigmoid(N(2, 2)) clipped, in about [-5, 0)
#   strong       about STRONG_DECAY per step: a chunk's cumulative decay reaches -50 * chunk_size
#   mixed        each element drawn from the four above
GATE_STRENGTHS = ("zero", "weak", "log_sigmoid", "strong", "mixed")
WEAK_DECAY = -1e-3
STRONG_DECAY = -50.0
# Strengths of an in-kernel gate (kda use_gate_in_kernel, kda_gate): make_case's `gate_scale` multiplies
# exp(A_log) (typical decays -0.5 * scale); "strong" also scales the raw gate input (softplus/sigmoid of
# about +-100).
IN_KERNEL_GATE_STRENGTHS = ("weak", "log_sigmoid", "strong")
IN_KERNEL_GATE_SCALE = {"weak": 2e-3, "log_sigmoid": 1.0, "strong": 100.0}
STRONG_RAW_GATE = 30.0


@dataclasses.dataclass(frozen=True, repr=False)
class Spec:
    """One example: everything needed to rebuild its arrays and its call.

    Attributes:
      op: "simple_gla", "gla", "kda" or "kda_gate".
      batch, seq_len, num_heads, key_dim, value_dim: B, T, H, K, V (value_dim unused by kda_gate).
      num_value_heads: kda and kda_gate: HV, a multiple of H (None: H).
      dtype: "float32" or "bfloat16".
      chunk_size: the requested chunk size.
      gates: simple_gla: which gates are given, a subset of ("g", "g_gamma").
      gate: strength of every gate, from GATE_STRENGTHS (IN_KERNEL_GATE_STRENGTHS for in-kernel gates).
      resets: number of `-inf` entries put at random (step, head[, key]) positions of the per-step gate.
      cu_seqlens: packed sequence boundaries (batch 1), or None.
      traced_cu_seqlens: run the call under its own `jax.jit` with cu_seqlens a traced argument.
      initial_state, output_final_state: h0 given, ht requested.
      use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, dt_bias, lower_bound: kda's
        options (dt_bias and lower_bound also kda_gate's); dt_bias says whether the array is given.
      seed: data seed.
    """

    op: str
    batch: int = 1
    seq_len: int = 16
    num_heads: int = 1
    key_dim: int = 16
    value_dim: int = 16
    num_value_heads: int | None = None
    dtype: str = "float32"
    chunk_size: int = 64
    gates: tuple[str, ...] = ("g",)
    gate: str = "log_sigmoid"
    resets: int = 0
    cu_seqlens: tuple[int, ...] | None = None
    traced_cu_seqlens: bool = False
    initial_state: bool = False
    output_final_state: bool = False
    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    use_beta_sigmoid_in_kernel: bool = False
    dt_bias: bool = True
    lower_bound: float | None = None
    seed: int = 0

    def __repr__(self) -> str:
        """Only the fields that differ from their defaults: short enough to paste into a regression case."""
        fields = [f"{self.op!r}"]
        for field in dataclasses.fields(self)[1:]:
            value = getattr(self, field.name)
            if value != field.default:
                fields.append(f"{field.name}={value!r}")
        return f"Spec({', '.join(fields)})"

    def _repr_pretty_(self, printer, cycle) -> None:
        """Hypothesis prints failing examples with this: the short repr."""
        printer.text(repr(self))

    @property
    def in_kernel_gate(self) -> bool:
        """The gate is a raw input turned into a log decay by the implementation (kda_gate's formula)."""
        return self.op == "kda_gate" or (self.op == "kda" and self.use_gate_in_kernel)

    @property
    def step_gate(self) -> str | None:
        """Name of the per-step log-decay input that can hold `-inf` resets (None: there is none)."""
        if self.in_kernel_gate:
            return None
        if self.op == "simple_gla":
            return "g" if "g" in self.gates else None
        return "gk" if self.op == "gla" else "g"


@dataclasses.dataclass(frozen=True)
class Poison:
    """A NaN put into one element of `k` or `v`: `tensor[batch_row, step, head, dim] = nan`."""

    tensor: str
    batch_row: int
    step: int
    head: int
    dim: int


def _make_case_arguments(spec: Spec) -> dict:
    arguments = dict(batch=spec.batch, seq_len=spec.seq_len, key_dim=spec.key_dim, dtype=spec.dtype, seed=spec.seed)
    if spec.in_kernel_gate:
        arguments.update(dt_bias=spec.dt_bias, lower_bound=spec.lower_bound, gate_scale=IN_KERNEL_GATE_SCALE[spec.gate])
    if spec.op == "kda_gate":
        return {**arguments, "num_heads": spec.num_heads, "num_value_heads": spec.num_value_heads}
    arguments.update(
        num_heads=spec.num_heads,
        value_dim=spec.value_dim,
        initial_state=spec.initial_state,
        output_final_state=spec.output_final_state,
        cu_seqlens=None if spec.cu_seqlens is None else list(spec.cu_seqlens),
        chunk_size=spec.chunk_size,
    )
    if spec.op == "simple_gla":
        arguments["gates"] = spec.gates
    if spec.op == "kda":
        arguments.update(
            num_value_heads=spec.num_value_heads,
            use_qk_l2norm_in_kernel=spec.use_qk_l2norm_in_kernel,
            use_gate_in_kernel=spec.use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=spec.use_beta_sigmoid_in_kernel,
        )
    return arguments


def _log_decays(strength: str, realistic: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Log decays of `strength` shaped like `realistic` (make_case's decays, used for "log_sigmoid")."""
    shape = realistic.shape
    menu = {
        "zero": np.zeros(shape),
        "weak": WEAK_DECAY * rng.uniform(0.5, 1.5, shape),
        "log_sigmoid": realistic,
        "strong": STRONG_DECAY * rng.uniform(0.5, 1.5, shape),
    }
    if strength == "mixed":
        return np.choose(rng.integers(0, len(menu), shape), list(menu.values()))
    return menu[strength]


def _with_resets(decays: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` entries set to -inf: a whole (b, t, h) step, or for per-key gates sometimes a single key."""
    decays = decays.copy()
    if decays.size == 0:
        return decays
    for _ in range(count):
        position = tuple(int(rng.integers(n)) for n in decays.shape[:3])
        if decays.ndim == 4 and rng.random() < 0.5:
            position += (int(rng.integers(decays.shape[3])),)
        decays[position] = -np.inf
    return decays


@functools.lru_cache(maxsize=2)  # the fuzz tests build each case twice: to ask explain, then to run it
def build_case(spec: Spec) -> testing.Case:
    """The `Case` of `spec`: make_case's arrays, then gates of `spec.gate` strength and `spec.resets` resets."""
    case = testing.make_case(spec.op, **_make_case_arguments(spec))
    rng = np.random.default_rng([spec.seed, 1])
    inputs = dict(case.inputs)
    as_float64 = lambda x: np.asarray(x, np.float64)
    if spec.in_kernel_gate:
        if spec.gate == "strong":
            inputs["g"] = jnp.asarray(as_float64(inputs["g"]) * STRONG_RAW_GATE, spec.dtype)
    else:
        for name in ("g", "gk", "g_gamma"):
            if name in inputs:
                decays = _log_decays(spec.gate, as_float64(inputs[name]), rng)
                if name == spec.step_gate:
                    decays = _with_resets(decays, spec.resets, rng)
                inputs[name] = jnp.asarray(decays, inputs[name].dtype)
    extras = [f"gate={spec.gate}"] + [f"resets={spec.resets}"] * (spec.resets > 0)
    extras += ["traced_cu_seqlens"] * spec.traced_cu_seqlens
    return dataclasses.replace(case, inputs=inputs, label=" ".join([case.label, *extras]))


def poisoned(case: testing.Case, poison: Poison) -> testing.Case:
    """`case` with a NaN at `poison`'s element of k or v."""
    inputs = dict(case.inputs)
    index = (poison.batch_row, poison.step, poison.head, poison.dim)
    inputs[poison.tensor] = inputs[poison.tensor].at[index].set(jnp.nan)
    return dataclasses.replace(case, inputs=inputs, label=f"{case.label} nan in {poison.tensor}{list(index)}")


def find_implementation(op: str, name: str) -> gla_core.Implementation:
    """The registered implementation `name` of `op`."""
    found = [implementation for implementation in gla_core.implementations(op) if implementation.name == name]
    if not found:
        raise LookupError(f"{op} has no registered implementation {name!r}")
    return found[0]


def interpret_mode(implementation: gla_core.Implementation) -> bool:
    """Whether `implementation` runs in TPU interpret mode: Pallas TPU kernels, off TPU hosts."""
    return implementation.interpretable and jax.default_backend() != "tpu"


def _call_options(implementation: gla_core.Implementation) -> dict:
    return {"interpret": True} if interpret_mode(implementation) else {}


def decline_reason(case: testing.Case, implementation: gla_core.Implementation) -> str | None:
    """Why `implementation` declines `case` (as `gla_core.explain` says), or None when it accepts it."""
    resolution = gla_core.explain(case.op, **case.kwargs(), **_call_options(implementation))
    verdicts = {candidate.implementation.name: candidate.reason for candidate in resolution.candidates}
    return verdicts[implementation.name]


def implementation_fn(spec: Spec, implementation: gla_core.Implementation):
    """`fn(**case.kwargs())` dispatching the spec's op to `implementation` (gla_ref.testing's calling convention).

    With `spec.traced_cu_seqlens` the call runs under its own `jax.jit` whose arguments are every
    array, cu_seqlens included, so the implementation sees traced boundaries as in a training step.
    """
    call = functools.partial(gla_core.dispatch, spec.op, impl=implementation.name, **_call_options(implementation))
    if not spec.traced_cu_seqlens:
        return call

    def traced_call(**kwargs):
        arrays = {name: value for name, value in kwargs.items() if isinstance(value, jax.Array)}
        static = {name: value for name, value in kwargs.items() if name not in arrays}
        return jax.jit(lambda arrays: call(**arrays, **static))(arrays)

    return traced_call
