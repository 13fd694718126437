"""Test helpers shared by every gla package: cases, the float64 oracle, error measures, tolerances.

A test builds a `Case` with `make_case`, then checks an implementation against the oracle:

  >>> case = make_case("simple_gla", seq_len=100, initial_state=True, output_final_state=True)
  >>> fn = lambda **kw: gla_core.dispatch("simple_gla", impl="chunk", **kw)
  >>> check_against_oracle(fn, case)          # outputs and every gradient, default tolerance

The oracle is the token-by-token recurrence of `gla_ref.recurrent` run in float64 under a
scoped `jax.enable_x64(True)`, on the case's inputs cast up from their dtype (so rounding the
inputs to bf16 is not counted as error). The function under test runs in the ambient
precision mode (float32/bf16 normally). Both get the same seeded cotangents, so gradients
are compared as vector-Jacobian products for every input in `case.differentiable`.

Errors are relative to the largest reference magnitude of each tensor:
`max|x - ref| / max|ref|`, computed in float64. A tensor computed by cancellation (large terms summing
to a small result) is held to `kappa S` instead when that is larger, S being how far one rounding of
the inputs at the case's precision moves it (`rounding_sensitivity`, `Tolerance.sensitivity_factor`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import re
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import gla_core
from gla_ref import recurrent

ATTENTION_OPS = ("simple_gla", "gla", "kda")
OPS = (*ATTENTION_OPS, "kda_gate")


# --------------------------------------------------------------------------- tolerances


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Largest accepted relative error for outputs and for gradients, and why.

    `sensitivity_factor` (kappa) lifts the bound of a tensor computed by cancellation: a tensor
    passes when `max|x - ref| <= max(bound max|ref|, kappa S)`, S its `rounding_sensitivity` (how far
    one rounding of the inputs moves it). 0 keeps the plain relative bound.
    """

    output: float
    grad: float
    reason: str
    sensitivity_factor: float = 0.0


TOLERANCES: dict[str, Tolerance] = {
    # ----- implementations against the float64 oracle, by input dtype (`tolerance_for`)
    "float32": Tolerance(
        output=1e-5,
        grad=1e-4,
        reason=(
            "float32 keeps 24 significand bits (unit roundoff 6e-8); chunked kernels sum up to a few hundred "
            "products per element, so errors of ~1e-6 of max|ref| are expected for outputs (measured: <= 1e-6 "
            "on every case). Gradients go through two such products and sums over the whole sequence, hence "
            "10x looser (measured: <= 1e-5, the worst d g_gamma under strong decay). Tensors computed by "
            "cancellation get the bfloat16 rule below (kappa S), with float32's unit roundoff."
        ),
        sensitivity_factor=5.0,
    ),
    "bfloat16": Tolerance(
        output=2e-2,
        grad=5e-2,
        reason=(
            "bfloat16 keeps 8 significand bits (unit roundoff 2^-9 = 2e-3). Inputs are rounded identically "
            "for the oracle, but the output is stored in bf16 (up to 2e-3 of max|ref| by itself) and kernels "
            "feed bf16 operands to the matrix unit (q.k, attention.v, decay-scaled k), each a relative 2^-9 "
            "perturbation summed over up to chunk_size terms. Gradients chain two such products and their "
            "sums over T and are stored in bf16 too, hence the looser gradient bound. A tensor whose "
            "elements are sums of large terms that cancel (tiny K or V, a few elements) can be off by more "
            "than that relative to its own max|ref| in any computation rounding to bf16: one rounding of the "
            "inputs already moves it by its sensitivity S, and a kernel rounds operands at several stages "
            "after that (decay-scaled keys, bf16 states between chunks, the delta and state-gradient "
            "operands). Measured up to 1.9 S over 460 tensors of 70 fuzzed bf16 cases of the Pallas kernels "
            "(kda dq at T=1 K=1: 0.16 of max|ref| = 1.3 S; kda d initial_state at K=V=1: 0.14 = 1.8 S); "
            "kappa = 5 leaves 2.6x room."
        ),
        sensitivity_factor=5.0,
    ),
    "float64": Tolerance(
        output=1e-12,
        grad=1e-12,
        reason=(
            "an implementation computing in float64 (jax_enable_x64 on, float64 inputs): unit roundoff 1.1e-16, "
            "a few hundred terms per element give ~1e-14 at worst; 1e-12 leaves 100x room and still tells a "
            "float64 computation from a float32 one (>= 1e-8). Cancellation: the bfloat16 rule below."
        ),
        sensitivity_factor=5.0,
    ),
    # ----- other comparisons, by name
    "float64_identity": Tolerance(
        output=1e-12,
        grad=1e-12,
        reason=(
            "two float64 forms of the same math (chunked vs recurrent oracle, g_gamma vs the same decay as g, "
            "gla with a key-constant gk vs simple_gla): only float64 round-off (~1e-15 over ~200 steps) differs."
        ),
    ),
    "finite_differences": Tolerance(
        output=1e-7,
        grad=1e-7,
        reason=(
            "float64 gradients against central differences with step 1e-5: truncation error ~1e-10 and "
            "round-off ~1e-11 relative to the loss; 1e-7 separates that from any wrong gradient term."
        ),
    ),
    "float32_building_block": Tolerance(
        output=1e-5,
        grad=1e-5,
        reason=(
            "one float32 building block (intra-chunk scores and their gradients, cumulative sums, triangular "
            "inverses, decay tables) against its direct float64 formula. Exponents reach -640 inside a chunk; "
            "the gradient with respect to the cumulative decay subtracts terms of size max|ref| and measures "
            "up to 2.1e-6 relative on some CPUs (AVX-512 vs AVX2 summation order), so 1e-5 keeps 5x room."
        ),
    ),
    "float32_elementwise": Tolerance(
        output=5e-6,
        grad=5e-6,
        reason=(
            "elementwise relative error of float32 transcendental functions (exp of an exactly representable "
            "argument) against float64: a few ulps (unit roundoff 6e-8, measured <= 4e-7); 5e-6 keeps 10x room. "
            "Per element, not relative to the largest value."
        ),
    ),
    "float32_accumulation": Tolerance(
        output=1.5e-6,
        grad=1.5e-6,
        reason=(
            "a float32 sum of at most 128 exact terms (a masked segment-sum matmul) against float64, relative to "
            "the sum of the terms' magnitudes in each row: round-to-nearest accumulation measures <= 3.0e-7 on "
            "64 terms of mixed magnitudes (20 seeds); 1.5e-6 keeps 5x room and fails an operand rounded to 16 "
            "bits (7.2e-6)."
        ),
    ),
    "bfloat16x3_product": Tolerance(
        output=2.0**-14,
        grad=2.0**-14,
        reason=(
            "a float32 product from the two-part bfloat16 split of its operands (three bfloat16 passes, gla-kda's "
            "dot_bf16x3, the bfloat16-input path's float32 intermediates) against float64, relative to max|ref|: "
            "the dropped low*low term and split tails are ~2^-16; measured 4.9e-6 (products) and 5.6e-6 (a unit "
            "lower-triangular inverse); 2^-14 = 6.1e-5 keeps 10x room and fails one bfloat16 pass (~2^-9)."
        ),
    ),
    "bfloat16x3_inverse": Tolerance(
        output=2.0**-12,
        grad=2.0**-12,
        reason=(
            "a unit lower-triangular inverse (I + Akk)^-1 from bfloat16x3 products (gla-kda's bfloat16-input path) "
            "of Akk formed from up to 128 nearly parallel unit keys, relative to max|ref|: the ~2^-16 product error "
            "grows with the matrix's componentwise condition number (up to 280 there); measured 3.7e-5 (block "
            "substitution: 3.3e-5); 2^-12 = 2.4e-4 keeps 6x room and fails one bfloat16 pass (~2^-9)."
        ),
    ),
    "uncompensated_decays": Tolerance(
        output=2.0**-10,
        grad=2.0**-10,
        reason=(
            "exp of the decay exponents G and G_last - G formed from a float32 sub-block cumsum without its "
            "compensation (gla-kda's state kernels on the bfloat16-input path), against float64, relative to "
            "max|ref| (= 1): four rounded additions per scanned sum of up to 16 * 104 give at most "
            "4 eps (|tau| + |L|) = 4e-4; measured 1.7e-4 (the first 8 or 12 steps of every sub-block at the "
            "floor, the rest weak); 2^-10 = 9.8e-4 stays below the bfloat16 rounding (2^-9) of the matrix-unit "
            "operand each decay scales."
        ),
    ),
    "float32_rearranged": Tolerance(
        output=1e-5,
        grad=1e-5,
        reason=(
            "the same float32 computation arranged differently (packed varlen vs sequence by sequence, vmap vs "
            "a loop, one grid step vs several): only the summation order differs, ~1e-7 relative; 1e-5 leaves "
            "100x room without hiding a wrong term (those are O(1))."
        ),
    ),
}


def tolerance_for(dtype) -> Tolerance:
    """The tolerance of an implementation whose inputs have `dtype`, against the float64 oracle."""
    name = jnp.dtype(dtype).name
    if name not in ("float32", "bfloat16", "float64"):
        raise KeyError(f"no oracle tolerance for dtype {name}; known: float32, bfloat16, float64")
    return TOLERANCES[name]


# --------------------------------------------------------------------------- measured margins
#
# Every passing `assert_close` / `check_against_oracle` records (label, tensor, error, bound) so a
# test session can report how close the measured errors came to their bounds (see the root conftest).

_MEASURED: list[tuple[str, str, float, float]] = []


def record_error(label: str, name: str, error: float, bound: float) -> None:
    """Remembers one measured error and its bound (for the margin report of a test session)."""
    if bound > 0:
        _MEASURED.append((label, name, float(error), float(bound)))


def measured_errors() -> list[tuple[str, str, float, float]]:
    """Every (label, tensor, error, bound) recorded in this process, in order."""
    return list(_MEASURED)


# --------------------------------------------------------------------------- errors


def _as_float64(x) -> np.ndarray:
    return np.asarray(jax.device_get(x)).astype(np.float64)


# Below these magnitudes a dtype no longer resolves values with its full precision (products of
# O(1) numbers with them underflow): a tensor whose reference is smaller is compared against this
# scale instead of its own, so e.g. a gradient of 7e-33 computed as 0 in float32 is not "100% off".
RESOLUTION_FLOOR = {"float64": 1e-300, "float32": 1e-30, "bfloat16": 1e-30, "float16": 1e-30}


def _resolution_floor(x) -> float:
    dtype = getattr(x, "dtype", None)
    return RESOLUTION_FLOOR.get(np.dtype(dtype).name if dtype is not None else "", 0.0)


def relative_error(x, ref, floor: float | None = None) -> float:
    """`max|x - ref| / max(max|ref|, floor)` in float64; `floor` defaults to `RESOLUTION_FLOOR` of
    x's dtype (0 for other inputs).

    0 when both are identical (also for an all-zero or empty `ref`), inf when `ref` is all
    zeros but `x` is not (and the floor is 0), or when `x` has a NaN or an infinity.
    """
    floor = _resolution_floor(x) if floor is None else floor
    x, ref = _as_float64(x), _as_float64(ref)
    if x.shape != ref.shape:
        raise ValueError(f"relative_error: shapes differ, got {x.shape} and reference {ref.shape}")
    if x.size == 0:
        return 0.0
    if not np.isfinite(x).all():
        return float("inf")
    diff = float(np.max(np.abs(x - ref)))
    scale = max(float(np.max(np.abs(ref))), floor)
    if diff == 0.0:
        return 0.0
    if scale == 0.0:
        return float("inf")
    return diff / scale


def describe_mismatch(name: str, x, ref, tol: float, floor: float | None = None) -> str:
    """One line: tensor name, relative error vs tolerance, and the worst element with both values."""
    x64, ref64 = _as_float64(x), _as_float64(ref)
    error = relative_error(x64, ref64, _resolution_floor(x) if floor is None else floor)
    line = f"{name}: relative error {error:.3e} > tol {tol:.1e} (shape {x64.shape}, max|ref| {np.abs(ref64).max():.4g})"
    if x64.size == 0:
        return line
    bad = ~np.isfinite(x64)
    worst = np.argmax(bad) if bad.any() else np.argmax(np.abs(x64 - ref64))
    index = tuple(int(i) for i in np.unravel_index(worst, x64.shape))
    return f"{line}; worst at index {index}: got {x64[index]:.6g}, expected {ref64[index]:.6g}"


def assert_close(name: str, x, ref, tol: float, *, label: str = "") -> None:
    """Raises AssertionError naming the tensor, its error, `tol` and the worst element when too far."""
    error = relative_error(x, ref)
    if not error <= tol:
        raise AssertionError(describe_mismatch(name, x, ref, tol))
    record_error(label, name, error, tol)


# --------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One test problem.

    Attributes:
      op: "simple_gla", "gla", "kda" or "kda_gate".
      inputs: every array argument by its op keyword name (q, k, v, g, g_gamma, gk, beta,
        initial_state, A_log, dt_bias; kda_gate: g, A_log, dt_bias). Absent options are absent.
      options: everything else (scale, output_final_state, cu_seqlens as an int32 array or None,
        chunk_size, use_* flags, lower_bound).
      differentiable: names in `inputs` that get gradients (every float input).
      label: short human description.
    """

    op: str
    inputs: dict[str, jax.Array]
    options: dict[str, Any]
    differentiable: tuple[str, ...]
    label: str

    def kwargs(self) -> dict[str, Any]:
        """`{**inputs, **options}`: call `fn(**case.kwargs())`."""
        return {**self.inputs, **self.options}

    @property
    def dtype(self) -> jnp.dtype:
        """dtype of the main input (q; g for kda_gate): selects the default tolerance."""
        return jnp.dtype(self.inputs["g" if self.op == "kda_gate" else "q"].dtype)

    @property
    def output_names(self) -> tuple[str, ...]:
        """Names of the compared outputs: ("o",) or ("o", "final_state"); ("gate",) for kda_gate."""
        if self.op == "kda_gate":
            return ("gate",)
        return ("o", "final_state") if self.options.get("output_final_state") else ("o",)

    def __repr__(self) -> str:
        return f"Case({self.label})"


def alibi_g_gamma(num_heads: int) -> np.ndarray:
    """ALiBi-slope log decays `-(2 ** (-8 (h + 1) / H))`, `[H]` float32, all negative."""
    heads = np.arange(1, num_heads + 1, dtype=np.float64)
    return (-(2.0 ** (-8.0 * heads / num_heads))).astype(np.float32)


def random_cu_seqlens(total_len: int, num_sequences: int, rng: np.random.Generator, allow_empty: bool = True):
    """Random boundaries `[0, ..., total_len]` of `num_sequences` packed sequences.

    With `allow_empty`, cut points are drawn with replacement from [0, total_len], so
    zero-length sequences occur; otherwise every sequence has at least one token.
    """
    if num_sequences < 1:
        raise ValueError(f"num_sequences: expected >= 1, got {num_sequences}")
    if allow_empty:
        cuts = rng.integers(0, total_len + 1, size=num_sequences - 1)
    else:
        if total_len < num_sequences:
            raise ValueError(f"total_len: {num_sequences} non-empty sequences need >= {num_sequences} tokens")
        cuts = rng.choice(np.arange(1, total_len), size=num_sequences - 1, replace=False)
    return [0, *sorted(int(c) for c in cuts), int(total_len)]


def _log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


def _decays(rng: np.random.Generator, shape, gate_scale: float) -> np.ndarray:
    """Log decays `gate_scale * log_sigmoid(x)`, x ~ N(2, 2) clipped at -5: in about [-5 gate_scale, 0).

    Most steps decay slowly (median exp(g) ~ 0.88) so states carry across chunks; some
    decay fast (down to exp(-5)).
    """
    x = np.clip(rng.normal(2.0, 2.0, size=shape), -5.0, None)
    return gate_scale * _log_sigmoid(x)


def _normal(rng, shape) -> np.ndarray:
    return rng.standard_normal(size=shape)


def make_case(
    op: str,
    *,
    batch: int = 1,
    seq_len: int = 64,
    num_heads: int = 2,
    key_dim: int = 32,
    value_dim: int = 32,
    num_value_heads: int | None = None,
    dtype=jnp.float32,
    gates=None,
    initial_state: bool = False,
    output_final_state: bool = False,
    cu_seqlens=None,
    chunk_size: int = 64,
    scale: float | None = None,
    seed: int = 0,
    gate_scale: float = 1.0,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    dt_bias: bool = True,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
) -> Case:
    """A realistic random problem for `op`.

    Data (numpy generator seeded by `seed`, then cast to `dtype`):
      q, k, v ~ N(0, 1). For kda without `use_qk_l2norm_in_kernel`, k rows are normalized to
        unit length so each delta-rule step `I - beta k k^T` is a contraction (stable states).
      Log decays g / gk (and kda's g): `gate_scale * log_sigmoid(x)`, x ~ N(2, 2) clipped at -5,
        so in about [-5 gate_scale, 0); g_gamma: `gate_scale * alibi_g_gamma(H)` (float32).
      kda beta: sigmoid(N(0, 1.5)) in (0, 1), or the raw logits N(0, 1.5) when
        `use_beta_sigmoid_in_kernel` (with `allow_neg_eigval` the op makes them 2 sigmoid, in (0, 2)).
      kda with a `lower_bound` but no in-kernel gate (FLA's safe-gate calls): g is clipped to
        [lower_bound, 0], the bound the call states.
      In-kernel kda gate (`use_gate_in_kernel`, and the kda_gate op): raw g ~ N(0, 1),
        A_log ~ U(-1, 0.5) + log(gate_scale) (float32 [HV]), dt_bias ~ N(-1, 0.5) (float32
        [HV*K], present when `dt_bias`), so typical decays are about -0.5 per step.
      initial_state ~ N(0, 1), float32 `[N, HV, K, V]`.
    Gates and beta have the case's dtype; g_gamma, A_log, dt_bias and states are float32.

    Args:
      op: "simple_gla", "gla", "kda" or "kda_gate".
      gates: simple_gla only: subset of ("g", "g_gamma"), default ("g",); () for no decay.
      num_value_heads: kda (and kda_gate) only: HV, a multiple of num_heads (default num_heads).
        For kda_gate the gate has `num_value_heads or num_heads` heads.
      cu_seqlens: list of boundaries `[0, ..., seq_len]` (batch must be 1) or None.
      Others: the op's options, stored in `case.options`.
    """
    if op not in OPS:
        raise ValueError(f"op: expected one of {OPS}, got {op!r}")
    heads_v = num_heads if num_value_heads is None else num_value_heads
    if op in ("simple_gla", "gla") and heads_v != num_heads:
        raise ValueError(f"num_value_heads: grouped value heads are kda-only, got {heads_v} for {op}")
    if heads_v % num_heads:
        raise ValueError(f"num_value_heads: expected a multiple of num_heads = {num_heads}, got {heads_v}")
    if cu_seqlens is not None:
        cu_seqlens = [int(c) for c in cu_seqlens]
        if batch != 1:
            raise ValueError(f"cu_seqlens: packed sequences need batch == 1, got batch = {batch}")
        if cu_seqlens[0] != 0 or cu_seqlens[-1] != seq_len or any(b < a for a, b in itertools.pairwise(cu_seqlens)):
            raise ValueError(f"cu_seqlens: expected non-decreasing [0, ..., seq_len={seq_len}], got {cu_seqlens}")
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(dtype)
    cast = lambda x: jnp.asarray(x, dtype)
    f32 = lambda x: jnp.asarray(x, jnp.float32)

    if op == "kda_gate":
        return _gate_case(rng, batch, seq_len, heads_v, key_dim, dtype, dt_bias, lower_bound, gate_scale, seed)

    inputs: dict[str, jax.Array] = {}
    inputs["q"] = cast(_normal(rng, (batch, seq_len, num_heads, key_dim)))
    k = _normal(rng, (batch, seq_len, num_heads, key_dim))
    if op == "kda" and not use_qk_l2norm_in_kernel:
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    inputs["k"] = cast(k)
    inputs["v"] = cast(_normal(rng, (batch, seq_len, heads_v, value_dim)))
    options: dict[str, Any] = {}
    flags = []
    if op == "simple_gla":
        gates = ("g",) if gates is None else tuple(gates)
        unknown = set(gates) - {"g", "g_gamma"}
        if unknown:
            raise ValueError(f"gates: simple_gla takes a subset of ('g', 'g_gamma'), got {gates}")
        if "g" in gates:
            inputs["g"] = cast(_decays(rng, (batch, seq_len, num_heads), gate_scale))
        if "g_gamma" in gates:
            inputs["g_gamma"] = f32(gate_scale * alibi_g_gamma(num_heads))
        flags.append("gates=" + ("+".join(gates) or "none"))
    elif op == "gla":
        inputs["gk"] = cast(_decays(rng, (batch, seq_len, num_heads, key_dim), gate_scale))
    else:
        gate_shape = (batch, seq_len, heads_v, key_dim)
        if use_gate_in_kernel:
            inputs["g"] = cast(_normal(rng, gate_shape))
            inputs["A_log"] = f32(rng.uniform(-1.0, 0.5, size=heads_v) + np.log(gate_scale))
            if dt_bias:
                inputs["dt_bias"] = f32(rng.normal(-1.0, 0.5, size=heads_v * key_dim))
            flags.append("gate_in_kernel" + ("+dt_bias" if dt_bias else "") + _bound_label(lower_bound))
        else:
            decays = _decays(rng, gate_shape, gate_scale)
            if lower_bound is not None:  # the bound of a precomputed gate (FLA's safe-gate calls)
                decays = np.clip(decays, lower_bound, 0.0)
                flags.append(f"g>={lower_bound}")
            inputs["g"] = cast(decays)
        logits = rng.normal(0.0, 1.5, size=(batch, seq_len, heads_v))
        inputs["beta"] = cast(logits if use_beta_sigmoid_in_kernel else 1.0 / (1.0 + np.exp(-logits)))
        options.update(
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            lower_bound=lower_bound,
        )
        if allow_neg_eigval:
            options["allow_neg_eigval"] = True
        flags += ["l2norm"] * use_qk_l2norm_in_kernel + ["beta_sigmoid"] * use_beta_sigmoid_in_kernel
        flags += ["neg_eigval"] * allow_neg_eigval

    num_states = batch if cu_seqlens is None else len(cu_seqlens) - 1
    if initial_state:
        inputs["initial_state"] = f32(_normal(rng, (num_states, heads_v, key_dim, value_dim)))
    options.update(
        scale=scale,
        output_final_state=output_final_state,
        cu_seqlens=None if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32),
        chunk_size=chunk_size,
    )
    heads = f"H={num_heads}" + (f" HV={heads_v}" if heads_v != num_heads else "")
    parts = [f"{op} B={batch} T={seq_len} {heads} K={key_dim} V={value_dim} {dtype.name}", *flags]
    if cu_seqlens is not None:
        parts.append(f"cu_seqlens={cu_seqlens}")
    parts += ["h0"] * initial_state + ["ht"] * output_final_state
    parts += [f"chunk={chunk_size}", f"seed={seed}"]
    parts += [f"gate_scale={gate_scale}"] * (gate_scale != 1.0) + [f"scale={scale}"] * (scale is not None)
    return Case(op, inputs, options, tuple(inputs), " ".join(parts))


def _bound_label(lower_bound) -> str:
    return "" if lower_bound is None else f" lower_bound={lower_bound}"


def _gate_case(rng, batch, seq_len, heads_v, key_dim, dtype, dt_bias, lower_bound, gate_scale, seed) -> Case:
    inputs = {"g": jnp.asarray(_normal(rng, (batch, seq_len, heads_v, key_dim)), dtype)}
    inputs["A_log"] = jnp.asarray(rng.uniform(-1.0, 0.5, size=heads_v) + np.log(gate_scale), jnp.float32)
    if dt_bias:
        inputs["dt_bias"] = jnp.asarray(rng.normal(-1.0, 0.5, size=heads_v * key_dim), jnp.float32)
    label = f"kda_gate B={batch} T={seq_len} HV={heads_v} K={key_dim} {dtype.name}"
    label += " dt_bias" * dt_bias + _bound_label(lower_bound) + f" seed={seed}"
    return Case("kda_gate", inputs, {"lower_bound": lower_bound}, tuple(inputs), label)


# --------------------------------------------------------------------------- oracle


@dataclasses.dataclass(frozen=True)
class OracleResult:
    """Float64 outputs (`o`, `final_state`; or `gate`) and gradients (`"d" + input name`) as numpy arrays."""

    outputs: dict[str, np.ndarray]
    grads: dict[str, np.ndarray]


_RECURRENT = {
    "simple_gla": recurrent.simple_gla,
    "gla": recurrent.gla,
    "kda": recurrent.kda,
    "kda_gate": recurrent.kda_gate,
}


def _outputs_tuple(op: str, result) -> tuple:
    """fn results as a tuple aligned with `Case.output_names`."""
    if op == "kda_gate":
        return (result,)
    o, final_state = result
    return (o, final_state)


def _output_dtype(case: Case, name: str):
    """The dtype an implementation returns output `name` in: o in v's dtype, states in float32
    (float64 for float64 cases), the kda_gate gate in float32 (float64 for float64 g)."""
    wide = jnp.float64 if case.dtype == jnp.float64 else jnp.float32
    return case.inputs["v"].dtype if name == "o" else wide


def cotangents(case: Case, shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """Seeded N(0, 1) cotangents (as float64 arrays) for each output name of `case` with the given
    shapes, rounded to the dtype the implementation returns that output in: the implementation
    and the oracle then differentiate against the same numbers, as with the inputs."""
    rng = np.random.default_rng(seed)
    rounded = {}
    for name in case.output_names:
        values = jnp.asarray(rng.standard_normal(size=shapes[name]), _output_dtype(case, name))
        rounded[name] = np.asarray(values).astype(np.float64)
    return rounded


def _output_shapes(case: Case) -> dict[str, tuple[int, ...]]:
    if case.op == "kda_gate":
        return {"gate": tuple(case.inputs["g"].shape)}
    v = case.inputs["v"]
    q = case.inputs["q"]
    cu = case.options.get("cu_seqlens")
    num_states = q.shape[0] if cu is None else cu.shape[0] - 1
    return {"o": tuple(v.shape), "final_state": (num_states, v.shape[2], q.shape[3], v.shape[3])}


# The oracle is compiled once per problem signature with XLA's backend optimizations off: on CPU
# that compiles ~3x faster, and at test sizes the slower float64 run does not matter.
ORACLE_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}
ORACLE_CACHE_SIZE = 64
_compiled_oracles: collections.OrderedDict = collections.OrderedDict()


def _oracle_vjp(op, names, static_options, differentiable, constant, array_options, cts):
    """Float64 outputs and VJP of the recurrence; compiled executables are cached by signature."""
    fn = _RECURRENT[op]

    def forward_and_vjp(differentiable, constant, array_options, cts):
        def forward(*values):
            result = fn(**dict(zip(names, values, strict=True)), **constant, **array_options, **dict(static_options))
            return _outputs_tuple(op, result)

        outputs, vjp = jax.vjp(forward, *differentiable)
        return outputs, vjp(cts)

    args = (differentiable, constant, array_options, cts)
    leaves, tree = jax.tree.flatten(args)
    key = (op, names, static_options, tree, tuple((x.shape, x.dtype) for x in leaves))
    if key in _compiled_oracles:
        _compiled_oracles.move_to_end(key)
    else:
        _compiled_oracles[key] = jax.jit(forward_and_vjp).lower(*args).compile(ORACLE_COMPILER_OPTIONS)
        if len(_compiled_oracles) > ORACLE_CACHE_SIZE:
            _compiled_oracles.popitem(last=False)
    return _compiled_oracles[key](*args)


def _split_options(case: Case):
    """(static hashable options, array options) for the oracle; chunk_size is dropped."""
    static, arrays = [], {}
    for name, value in case.options.items():
        if name == "chunk_size":
            continue
        if isinstance(value, jax.Array | np.ndarray):
            arrays[name] = jnp.asarray(value)
        else:
            static.append((name, value))
    return tuple(sorted(static)), arrays


def oracle(case: Case, *, cotangent_seed: int = 0, perturbation: Perturbation | None = None) -> OracleResult:
    """Float64 forward and VJP of the recurrence on `case`, with the seeded cotangents.

    Runs under a scoped `jax.enable_x64(True)`: inputs are cast up from the case's dtype to
    float64. Returns numpy float64 arrays: `.outputs` ("o" and, when requested,
    "final_state"; "gate" for kda_gate) and `.grads` ("d" + name for every differentiable input).
    With `perturbation`, every float input and cotangent is perturbed by it first (`rounding_sensitivity`).
    """
    shapes = _output_shapes(case)
    cts = cotangents(case, shapes, cotangent_seed)
    static, array_options = _split_options(case)
    names = case.differentiable
    perturb = perturbation.apply if perturbation is not None else (lambda name, x: x)
    cts = {n: perturb(n, x) for n, x in cts.items()}
    with jax.enable_x64(True):
        up = lambda n, x: jnp.asarray(perturb(n, _as_float64(x)))
        differentiable = tuple(up(n, case.inputs[n]) for n in names)
        constant = {n: up(n, x) for n, x in case.inputs.items() if n not in names}
        array_options = {n: jnp.asarray(np.asarray(x)) for n, x in array_options.items()}
        ct_tuple = tuple(jnp.asarray(cts[n]) for n in case.output_names)
        if case.op != "kda_gate" and len(ct_tuple) == 1:
            ct_tuple = (ct_tuple[0], None)
        outputs, grads = _oracle_vjp(case.op, names, static, differentiable, constant, array_options, ct_tuple)
        out = {n: _as_float64(x) for n, x in zip(case.output_names, outputs, strict=False)}
        grad = {"d" + n: _as_float64(x) for n, x in zip(names, grads, strict=True)}
    return OracleResult(out, grad)


# Inputs that are log-space gates or gate parameters: rounding perturbs them by an absolute amount
# (a relative change of the decay), every other input relatively.
LOG_SPACE_INPUTS = frozenset({"g", "g_gamma", "gk", "A_log", "dt_bias"})

# Unit roundoff of the precision a kernel rounds its matrix-unit operands to, by input dtype.
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8}


@dataclasses.dataclass(frozen=True)
class Perturbation:
    """Random rounding-sized changes of every float input and cotangent: x (1 + u e) for data,
    x + u e for `LOG_SPACE_INPUTS`, with e uniform in [-1, 1] drawn from `seed` per tensor."""

    unit_roundoff: float
    seed: int

    def apply(self, name: str, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float64)
        if x.size == 0:
            return x
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        change = self.unit_roundoff * rng.uniform(-1.0, 1.0, size=x.shape)
        return np.where(np.isfinite(x), x + change if name in LOG_SPACE_INPUTS else x * (1.0 + change), x)


SENSITIVITY_SAMPLES = 4


def rounding_sensitivity(case: Case, reference: OracleResult | None = None, *, cotangent_seed: int = 0):
    """How far one rounding of the inputs moves each result: `{name: max|oracle(perturbed) - oracle|}`.

    The largest change over `SENSITIVITY_SAMPLES` random perturbations of every float input and
    cotangent by the unit roundoff of the case's dtype (`UNIT_ROUNDOFF`). A result computed by
    cancellation (a sum of large terms that is small) has a sensitivity far above `u max|ref|`: no
    computation that rounds its operands to the case's precision gets it closer than that.
    """
    reference = oracle(case, cotangent_seed=cotangent_seed) if reference is None else reference
    unit = UNIT_ROUNDOFF[case.dtype.name]
    changes: dict[str, float] = collections.defaultdict(float)
    for sample in range(SENSITIVITY_SAMPLES):
        moved = oracle(case, cotangent_seed=cotangent_seed, perturbation=Perturbation(unit, sample))
        for group, base in ((moved.outputs, reference.outputs), (moved.grads, reference.grads)):
            for name, value in group.items():
                finite = np.isfinite(value) & np.isfinite(base[name])
                change = float(np.max(np.abs(value - base[name]), where=finite, initial=0.0))
                changes[name] = max(changes[name], change)
    return dict(changes)


def cancellation_bound(tolerance: Tolerance, sensitivity: float, reference, floor: float) -> float:
    """`kappa S / max|ref|`: the relative bound of a tensor whose `rounding_sensitivity` is S."""
    scale = max(float(np.max(np.abs(reference), initial=0.0)), floor)
    return tolerance.sensitivity_factor * sensitivity / scale if scale > 0 else 0.0


# --------------------------------------------------------------------------- comparison


def _run_fn(fn, case: Case, cotangent_seed: int):
    """fn's outputs and VJP on `case` as numpy dicts keyed like `OracleResult`.

    Forward and VJP run as one `jax.jit` program over the differentiable inputs; the other
    inputs and the options (cu_seqlens included) are closed over as constants.
    """
    names = case.differentiable
    constant = {n: x for n, x in case.inputs.items() if n not in names}
    values = tuple(case.inputs[n] for n in names)

    def forward(*values):
        return _outputs_tuple(case.op, fn(**dict(zip(names, values, strict=True)), **constant, **case.options))

    shapes = jax.eval_shape(forward, *values)
    expected = _output_shapes(case)
    for name, value in zip(case.output_names, shapes, strict=False):
        if value is None:
            raise AssertionError(f"{case.label}: fn returned no {name} (output_final_state=True)")
        if tuple(value.shape) != expected[name]:
            raise AssertionError(f"{case.label}: {name} has shape {tuple(value.shape)}, expected {expected[name]}")
    cts = cotangents(case, expected, cotangent_seed)
    all_names = ("gate",) if case.op == "kda_gate" else ("o", "final_state")
    ct_tuple = tuple(_cotangent(cts.get(name), value) for name, value in zip(all_names, shapes, strict=True))

    @jax.jit
    def forward_and_vjp(values, ct_tuple):
        outputs, vjp = jax.vjp(forward, *values)
        return outputs, vjp(ct_tuple)

    outputs, grads = forward_and_vjp(values, ct_tuple)
    out = {n: _as_float64(x) for n, x in zip(case.output_names, outputs, strict=False)}
    grad = {"d" + n: _as_float64(x) for n, x in zip(names, grads, strict=True)}
    return out, grad


def _cotangent(ct: np.ndarray | None, value):
    """`ct` in the dtype of `value`; zeros for an output that is returned but not compared."""
    if value is None:
        return None
    if ct is None:
        return jnp.zeros(value.shape, value.dtype)
    return jnp.asarray(ct, value.dtype)


def _compare(fn, case: Case, cotangent_seed: int):
    """(errors, pairs, reference) of `fn` on `case`: see `_errors_against`."""
    reference = oracle(case, cotangent_seed=cotangent_seed)
    outputs, grads = _run_fn(fn, case, cotangent_seed)
    return (*_errors_against({**outputs, **grads}, case, reference), reference)


def _errors_against(values: dict[str, Any], case: Case, reference: OracleResult):
    """(errors, pairs): relative error per tensor of `values` (keyed like the oracle's results) and the
    (value, reference) pairs behind it."""
    expected = {**reference.outputs, **reference.grads}
    unknown = sorted(set(values) - set(expected))
    if unknown:
        raise KeyError(f"values: no oracle result named {unknown}; known: {sorted(expected)}")
    floor = RESOLUTION_FLOOR[case.dtype.name]  # the implementation's outputs were cast up to float64
    pairs = {n: (_as_float64(values[n]), expected[n]) for n in expected if n in values}
    errors = {n: relative_error(x, ref, floor) for n, (x, ref) in pairs.items()}
    return errors, pairs


def compare_with_oracle(fn, case: Case, *, cotangent_seed: int = 0) -> dict[str, float]:
    """Relative errors of `fn` vs the float64 oracle on `case`, outputs and every gradient.

    `fn(**case.kwargs())` returns `(o, final_state)` (kda_gate: the gate). Its forward and
    VJP (`jax.vjp` over `case.differentiable`) run as one `jax.jit` program, with the other
    inputs and the options (cu_seqlens included) closed over as constants, in the ambient
    precision mode, with the oracle's seeded cotangents cast to each output's dtype.

    Returns:
      `{"o": .., "final_state": .. (when requested), "dq": .., ...}`; kda_gate: `{"gate", "dg", ...}`.
    """
    errors, _, _ = _compare(fn, case, cotangent_seed)
    return errors


def check_against_oracle(fn, case: Case, tolerance: Tolerance | float | None = None) -> dict[str, float]:
    """`compare_with_oracle`, then asserts every error is within `tolerance`.

    Args:
      fn, case: as `compare_with_oracle`.
      tolerance: a `Tolerance` (outputs use `.output`, gradients `.grad`), a float for both,
        or None for `TOLERANCES[case dtype]`. A tensor beyond its bound still passes within
        `cancellation_bound` (the tolerance's `sensitivity_factor`).

    Returns:
      The errors, when all pass. Otherwise raises AssertionError listing every failing tensor
      with its error, tolerance and worst element.
    """
    errors, pairs, reference = _compare(fn, case, 0)
    _assert_within(case, _as_tolerance(case, tolerance), errors, pairs, reference)
    return errors


def check_values_against_oracle(values: dict[str, Any], case: Case, tolerance: Tolerance | float | None = None):
    """`check_against_oracle` for results computed elsewhere: `{oracle name: array}` (outputs such as
    "o" or "final_state", gradients "d" + input name), against the oracle with the seeded cotangents."""
    reference = oracle(case)
    errors, pairs = _errors_against(values, case, reference)
    _assert_within(case, _as_tolerance(case, tolerance), errors, pairs, reference)


def _as_tolerance(case: Case, tolerance: Tolerance | float | None) -> Tolerance:
    if tolerance is None:
        return tolerance_for(case.dtype)
    if isinstance(tolerance, Tolerance):
        return tolerance
    return Tolerance(float(tolerance), float(tolerance), "given")


def _assert_within(case: Case, tolerance: Tolerance, errors: dict[str, float], pairs: dict, reference) -> None:
    """Records each error against its bound, or raises AssertionError listing every tensor beyond it.

    `reference`: the `OracleResult` behind `pairs` (the base of `rounding_sensitivity`)."""
    floor = RESOLUTION_FLOOR[case.dtype.name]
    sensitivity = None  # the extra oracle runs happen only when a tensor exceeds its plain bound
    failures = []
    for name, error in errors.items():
        bound = tolerance.output if name in case.output_names else tolerance.grad
        if not error <= bound and tolerance.sensitivity_factor and np.isfinite(error):
            sensitivity = rounding_sensitivity(case, reference) if sensitivity is None else sensitivity
            bound = max(bound, cancellation_bound(tolerance, sensitivity[name], pairs[name][1], floor))
        if not error <= bound:
            failures.append(describe_mismatch(name, *pairs[name], bound, floor))
        else:
            record_error(case.label, name, error, bound)
    if failures:
        raise AssertionError(f"{case.label}: {len(failures)} tensor(s) off the oracle\n  " + "\n  ".join(failures))


# --------------------------------------------------------------------------- special inputs and transforms


def jit_dispatch(impl: str, case: Case):
    """`fn(**case.kwargs())` running `gla_core.dispatch(case.op, impl=impl)` under one `jax.jit`.

    Non-array options (flags, scale, chunk_size, lower_bound) are static; arrays, including
    `cu_seqlens`, are traced, as in a training step.
    """
    static = {name: value for name, value in case.options.items() if not isinstance(value, jax.Array)}

    @jax.jit
    def run(arrays):
        return gla_core.dispatch(case.op, impl=impl, **arrays, **static)

    def fn(**kwargs):
        return run({name: value for name, value in kwargs.items() if name not in static})

    return fn


def with_values(case: Case, name: str, indices, value: float) -> Case:
    """`case` with `inputs[name][index] = value` for every index (e.g. -inf gates, a NaN in v)."""
    x = case.inputs[name]
    for index in indices:
        x = x.at[index].set(value)
    return dataclasses.replace(case, inputs={**case.inputs, name: x}, label=f"{case.label} {name}={value}@{indices}")


def forward_and_vjp(fn, case: Case):
    """fn's outputs and gradients on `case` with the oracle's cotangents, as numpy dicts keyed like
    `OracleResult`, and the oracle itself: `(outputs, grads, oracle(case))`. For checks that need
    more than `check_against_oracle` (non-finite entries, exact zeros)."""
    names = case.differentiable
    constant = {n: x for n, x in case.inputs.items() if n not in names}
    reference = oracle(case)
    cts = cotangents(case, {n: x.shape for n, x in reference.outputs.items()}, seed=0)

    def forward(*values):
        return fn(**dict(zip(names, values, strict=True)), **constant, **case.options)

    @jax.jit
    def run(values, cts):
        outputs, vjp = jax.vjp(forward, *values)
        return outputs, vjp(tuple(ct.astype(out.dtype) for ct, out in zip(cts, outputs, strict=True)))

    cts = tuple(jnp.asarray(cts[n]) for n in ("o", "final_state"))
    outputs, grads = run(tuple(case.inputs[n] for n in names), cts)
    outputs = dict(zip(("o", "final_state"), map(np.asarray, outputs), strict=True))
    return outputs, {"d" + n: np.asarray(g) for n, g in zip(names, grads, strict=True)}, reference


def vmapped_against_oracle(fn, cases: list[Case], shared: set[str] = frozenset()) -> None:
    """`jax.vmap` of fn's forward and VJP over `cases`, each mapped element checked against the oracle
    of its case (outputs and every gradient, `tolerance_for` the dtype).

    The cases have equal shapes; their inputs and `cu_seqlens` are stacked along a new leading
    axis, except the names in `shared`, which must be equal in every case and stay unmapped.
    """
    first = cases[0]
    static = {n: x for n, x in first.options.items() if n != "cu_seqlens"}
    references = [oracle(case) for case in cases]
    cts = cotangents(first, {n: x.shape for n, x in references[0].outputs.items()}, seed=0)
    cts = tuple(jnp.asarray(cts[n]) if n in cts else None for n in ("o", "final_state"))

    def arrays(case):
        cu = case.options["cu_seqlens"]
        return {**case.inputs, **({} if cu is None else {"cu_seqlens": cu})}

    def one(mapped, unmapped):
        values = {**mapped, **unmapped}
        cu_seqlens = values.pop("cu_seqlens", None)
        outputs, vjp = jax.vjp(lambda values: fn(**values, cu_seqlens=cu_seqlens, **static), values)
        return outputs, vjp(cts)[0]

    mapped = {n: jnp.stack([arrays(case)[n] for case in cases]) for n in arrays(first) if n not in shared}
    unmapped = {n: x for n, x in arrays(first).items() if n in shared}
    outputs, grads = jax.jit(jax.vmap(one, in_axes=(0, None)))(mapped, unmapped)
    tolerance = tolerance_for(first.dtype)
    for i, (case, reference) in enumerate(zip(cases, references, strict=True)):
        label = f"{case.label} (vmapped element {i})"
        for name, value in zip(("o", "final_state"), outputs, strict=True):
            if name in reference.outputs:
                assert_close(name, value[i], reference.outputs[name], tolerance.output, label=label)
        for name in case.differentiable:
            assert_close("d" + name, grads[name][i], reference.grads["d" + name], tolerance.grad, label=label)


# --------------------------------------------------------------------------- XLA:CPU miscompile guard


def dots_on_broadcast_scalars(hlo_text: str) -> list[str]:
    """The dots of a compiled XLA:CPU program that read a broadcast scalar inside a fused
    computation that also reduces.

    XLA:CPU in jaxlib 0.10.2 miscompiles exactly that in its YNNPACK library fusions (the dot
    reads uninitialised memory: `jnp.sum(x, -1, keepdims=True) + x @ jnp.zeros((64, 64))` under
    `jax.jit` is wrong in about half the runs). The garbage depends on what ran before, so tests
    look for the pattern in the compiled HLO (`jax.jit(f).lower(...).compile().as_text()`)
    instead of hoping to see wrong numbers. Returns one line per offending dot.
    """
    found = []
    for computation in re.split(r"\n(?=%\S+ \()", hlo_text):
        if " reduce(" not in computation:
            continue
        scalars = set(re.findall(r"(%[\w.\-]+) = \S+ broadcast\(%[\w.\-]+\), dimensions=\{\}", computation))
        for line in computation.splitlines():
            match = re.search(r" dot\((%[\w.\-]+), (%[\w.\-]+)\)", line)
            if match and set(match.groups()) & scalars:
                found.append(line.strip()[:200])
    return found
