"""Every failure the fuzzer found, as a plain case: the implementation and the spec (and NaN) it printed.

When the fuzzer fails, paste the printed `Spec(...)` (made smaller by hand if it still fails the same
way) here under a comment naming the bug, so the case keeps running after the seed moves on.
"""

from __future__ import annotations

import pytest

from . import properties
from .specs import Poison, Spec, find_implementation


def _case(case_id: str, op_impl: str, spec: Spec, poison: Poison | None = None, known_bug: str | None = None):
    """`known_bug`: why the case still fails (an open bug, reported as xfail until it is fixed)."""
    op, name = op_impl.split("-")
    marks = [pytest.mark.interpret] if find_implementation(op, name).interpretable else [pytest.mark.oracle]
    if known_bug is not None:
        marks.append(pytest.mark.xfail(reason=known_bug, raises=AssertionError, strict=False))
    arguments = (name, spec) if poison is None else (name, spec, poison)
    return pytest.param(*arguments, id=f"{op_impl}-{case_id}", marks=marks)


ORACLE_CASES = [
    # B = 0: the Pallas kernels read out of bounds of the empty arrays (interpret mode IndexError).
    _case(
        "batch0",
        "simple_gla-fused_g_gamma",
        Spec("simple_gla", batch=0, seq_len=0, key_dim=1, value_dim=1, chunk_size=16, gates=("g_gamma",), gate="zero"),
    ),
    _case(
        "batch0",
        "simple_gla-fused_chunk",
        Spec("simple_gla", batch=0, seq_len=0, key_dim=1, value_dim=1, chunk_size=16, gates=(), gate="zero"),
    ),
    _case(
        "batch0-T44",
        "simple_gla-fused_chunk",
        Spec(
            "simple_gla",
            batch=0,
            seq_len=44,
            key_dim=2,
            value_dim=1,
            dtype="bfloat16",
            chunk_size=128,
            gates=("g_gamma",),
            gate="zero",
            output_final_state=True,
            seed=1796,
        ),
    ),
    _case(
        "batch0",
        "simple_gla-chunk",
        Spec("simple_gla", batch=0, seq_len=0, key_dim=1, value_dim=1, chunk_size=16, gates=(), gate="zero"),
    ),
    _case("batch0", "gla-chunk", Spec("gla", batch=0, seq_len=0, key_dim=1, value_dim=1, chunk_size=16, gate="zero")),
    _case("batch0", "kda-chunk", Spec("kda", batch=0, seq_len=0, key_dim=1, value_dim=1, chunk_size=16, gate="zero")),
    _case(
        "batch0-T64-gate-in-kernel",
        "kda-chunk",
        Spec(
            "kda",
            batch=0,
            seq_len=64,
            num_heads=2,
            key_dim=1,
            value_dim=60,
            num_value_heads=2,
            dtype="bfloat16",
            chunk_size=32,
            output_final_state=True,
            use_gate_in_kernel=True,
            lower_bound=-1.0,
            seed=330,
        ),
    ),
    # T = 0 (known from the issue; the fuzzer met B = 0 first): kda chunk failed on empty sequences.
    _case("T0", "kda-chunk", Spec("kda", seq_len=0, key_dim=8, value_dim=8, chunk_size=16)),
    _case("T0-varlen", "kda-chunk", Spec("kda", seq_len=0, key_dim=8, value_dim=8, chunk_size=16, cu_seqlens=(0, 0))),
    # -inf gates (hard resets): NaN outputs and gradients from differences of -inf cumulative sums.
    _case(
        "reset-weak-bf16",
        "simple_gla-fused_chunk",
        Spec(
            "simple_gla",
            seq_len=33,
            key_dim=1,
            value_dim=1,
            dtype="bfloat16",
            chunk_size=32,
            gate="weak",
            resets=3,
            initial_state=True,
            seed=9913,
        ),
    ),
    _case(
        "reset-g+g_gamma-strong",
        "simple_gla-fused_chunk",
        Spec(
            "simple_gla",
            seq_len=31,
            key_dim=1,
            value_dim=109,
            chunk_size=32,
            gates=("g", "g_gamma"),
            gate="strong",
            resets=3,
            seed=9375,
        ),
    ),
    _case(
        "reset-varlen-bf16",
        "simple_gla-chunk",
        Spec(
            "simple_gla",
            seq_len=31,
            num_heads=2,
            key_dim=1,
            value_dim=1,
            dtype="bfloat16",
            chunk_size=32,
            gates=("g", "g_gamma"),
            gate="weak",
            resets=2,
            cu_seqlens=(0, 31),
            output_final_state=True,
            seed=6028,
        ),
    ),
    _case(
        "reset-traced-varlen-empty-sequence",
        "simple_gla-chunk",
        Spec(
            "simple_gla",
            seq_len=1,
            key_dim=130,
            value_dim=68,
            gates=("g", "g_gamma"),
            gate="weak",
            resets=2,
            cu_seqlens=(0, 0, 1),
            traced_cu_seqlens=True,
            initial_state=True,
            output_final_state=True,
            seed=317,
        ),
    ),
    _case(
        "reset-traced-varlen-T1",
        "gla-chunk",
        Spec(
            "gla",
            seq_len=1,
            key_dim=1,
            value_dim=26,
            dtype="bfloat16",
            chunk_size=128,
            resets=3,
            cu_seqlens=(0, 1),
            traced_cu_seqlens=True,
            initial_state=True,
            output_final_state=True,
            seed=413,
        ),
    ),
    _case(
        "reset-mixed-h0-ht",
        "gla-chunk",
        Spec(
            "gla",
            batch=2,
            seq_len=39,
            num_heads=2,
            key_dim=57,
            value_dim=83,
            gate="mixed",
            resets=3,
            initial_state=True,
            output_final_state=True,
            seed=65536,
        ),
    ),
    _case(
        "reset-grouped-heads",
        "kda-chunk",
        Spec(
            "kda",
            seq_len=1,
            key_dim=29,
            value_dim=130,
            num_value_heads=2,
            dtype="bfloat16",
            chunk_size=128,
            gate="zero",
            resets=2,
            cu_seqlens=(0, 1),
            initial_state=True,
            seed=29,
        ),
    ),
    # One varlen sequence ending before the row's last chunk: a grid step of several chunks must
    # still emit its final state (and start its state gradient) there, not only at the step's last
    # chunk. Found with one sequence, when the layout padded even that to cdiv(T + C - 1, C) chunks.
    # The layout holds the worst case of N sequences, (T + N (C - 1)) // C chunks, which one sequence
    # fills: an empty second sequence makes the row a chunk longer than the sequence.
    _case(
        "one-sequence-ends-inside-a-step",
        "kda-chunk",
        Spec(
            "kda",
            seq_len=44,
            key_dim=14,
            value_dim=74,
            dtype="bfloat16",
            chunk_size=32,
            cu_seqlens=(0, 44, 44),
            initial_state=True,
            output_final_state=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            lower_bound=-5.0,
            seed=133,
        ),
    ),
    _case(
        "one-sequence-ends-inside-a-step",
        "simple_gla-chunk",
        Spec(
            "simple_gla",
            seq_len=42,
            key_dim=110,
            value_dim=64,
            dtype="bfloat16",
            chunk_size=16,
            gates=("g", "g_gamma"),
            cu_seqlens=(0, 42, 42),
            initial_state=True,
            output_final_state=True,
            seed=18,
        ),
    ),
    _case(
        "one-sequence-ends-inside-a-step",
        "gla-chunk",
        Spec(
            "gla",
            seq_len=42,
            key_dim=40,
            value_dim=24,
            chunk_size=16,
            cu_seqlens=(0, 42, 42),
            initial_state=True,
            output_final_state=True,
            seed=18,
        ),
    ),
    _case(
        "reset-varlen-h0-ht",
        "kda-xla",
        Spec(
            "kda",
            seq_len=3,
            num_heads=3,
            key_dim=128,
            value_dim=128,
            num_value_heads=3,
            gate="mixed",
            resets=3,
            cu_seqlens=(0, 3),
            initial_state=True,
            output_final_state=True,
            seed=377,
        ),
    ),
    _case(
        "reset-traced-varlen-empty-sequences",
        "kda-xla",
        Spec(
            "kda",
            seq_len=20,
            num_heads=2,
            key_dim=40,
            value_dim=40,
            num_value_heads=4,
            dtype="bfloat16",
            chunk_size=32,
            gate="weak",
            resets=2,
            cu_seqlens=(0, 0, 0, 0, 20, 20),
            traced_cu_seqlens=True,
            initial_state=True,
            output_final_state=True,
            use_beta_sigmoid_in_kernel=True,
            seed=11,
        ),
    ),
    _case(
        "reset-l2norm-batch2",
        "kda-xla",
        Spec(
            "kda",
            batch=2,
            seq_len=63,
            key_dim=129,
            value_dim=129,
            gate="zero",
            resets=1,
            use_qk_l2norm_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            seed=2,
        ),
    ),
    # Strong in-kernel gate with varlen: o off by 1.7e-4 (float32 bound 1e-5) once, while gla_kda was being
    # edited; it did not reproduce afterwards.
    _case(
        "strong-gate-in-kernel-varlen",
        "kda-chunk",
        Spec(
            "kda",
            seq_len=64,
            key_dim=87,
            value_dim=13,
            gate="strong",
            cu_seqlens=(0, 63, 64, 64, 64),
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            seed=608,
        ),
    ),
    # The forward compiled alone (no backward in the program) gave garbage (|o| ~ 1e14 .. 1e38, changing from
    # run to run): the XLA:CPU YNN fusion miscompile, met through the per-key "earlier sub-chunks" dot, all
    # zero when a chunk is one sub-chunk (chunk 16). Fixed in gla_simple.intra; the compiled HLO is checked
    # for the pattern in gla-simple's test_xla_sweep.
    _case(
        "forward-alone-garbage-fixed-length",
        "gla-xla",
        Spec(
            "gla",
            seq_len=99,
            num_heads=3,
            key_dim=179,
            value_dim=8,
            chunk_size=16,
            output_final_state=True,
            seed=1336,
        ),
    ),
    _case(
        "forward-alone-garbage-varlen-h0",
        "gla-xla",
        Spec(
            "gla",
            seq_len=170,
            num_heads=2,
            key_dim=32,
            value_dim=8,
            chunk_size=16,
            gate="mixed",
            cu_seqlens=(0, 170),
            initial_state=True,
            seed=108,
        ),
    ),
    # bfloat16 with one key (K = 1) and one step: dq = scale * sum_v do[v] S[v] cancels to 0.13 out of terms
    # ~1; the implementation gets the oracle's cotangent rounded to bf16 (o is bf16), the oracle uses it
    # unrounded, and that rounding alone was 7% of dq. gla_ref.testing.cotangents now rounds the cotangents
    # to each output's dtype for both.
    _case(
        "bf16-K1-cotangent-rounding",
        "gla-xla",
        Spec("gla", seq_len=1, key_dim=1, value_dim=183, dtype="bfloat16", cu_seqlens=(0, 1), seed=1),
    ),
    # Gradients whose true value is below what float32 resolves: max|ref| of dg_gamma is 7e-33 (a sum of ~1e-29
    # terms that cancel, strong decays), of kda's dg / dA_log 7e-114 (float32 rounds it to 0, relative error 1).
    # The relative error is now taken against max(max|ref|, RESOLUTION_FLOOR of the dtype) (gla_ref.testing).
    _case(
        "dg_gamma-7e-33",
        "simple_gla-fused_chunk",
        Spec(
            "simple_gla",
            batch=2,
            seq_len=64,
            key_dim=51,
            value_dim=66,
            gates=("g", "g_gamma"),
            gate="strong",
            resets=1,
            output_final_state=True,
            seed=37606,
        ),
    ),
    _case(
        "dA_log-7e-114",
        "kda-chunk",
        Spec(
            "kda",
            batch=2,
            seq_len=2,
            num_heads=2,
            key_dim=1,
            value_dim=53,
            num_value_heads=2,
            dtype="bfloat16",
            chunk_size=32,
            gate="strong",
            initial_state=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            dt_bias=False,
            lower_bound=-5.0,
            seed=2564,
        ),
    ),
    _case(
        "bf16-K1-cotangent-rounding",
        "gla-recurrent",
        Spec(
            "gla",
            seq_len=1,
            key_dim=1,
            value_dim=41,
            dtype="bfloat16",
            gate="strong",
            resets=3,
            cu_seqlens=(0, 1),
            initial_state=True,
            output_final_state=True,
            seed=65536,
        ),
    ),
    # bfloat16 d g_gamma 9.5e-2 > 5e-2: it sums d/da over the batch, 85 out of terms of 4400, and the
    # dq/dk/gate kernel's bfloat16 products were 10% of it (fixed: float32 products when d g_gamma is asked).
    _case(
        "bf16-dg_gamma-cancels",
        "simple_gla-chunk",
        Spec(
            "simple_gla",
            seq_len=35,
            key_dim=51,
            value_dim=128,
            dtype="bfloat16",
            chunk_size=128,
            gates=("g", "g_gamma"),
            gate="zero",
            cu_seqlens=(0, 0, 1, 35, 35),
            initial_state=True,
            seed=1127,
        ),
    ),
    _case(
        "bf16-dg_gamma-cancels",
        "simple_gla-fused_chunk",
        Spec(
            "simple_gla",
            seq_len=34,
            key_dim=51,
            value_dim=128,
            dtype="bfloat16",
            chunk_size=128,
            gates=("g", "g_gamma"),
            gate="zero",
            initial_state=True,
            seed=1128,
        ),
    ),
    # K = V = 1: each element of d initial_state is a sum of terms ~40x its size; bf16 matrix-unit operands
    # put it 0.14 of max|ref| off (one rounding of inputs and cotangents alone moves it 0.08): within kappa S, not 5e-2.
    _case(
        "bf16-dh0-cancels",
        "kda-chunk",
        Spec(
            "kda",
            seq_len=61,
            num_heads=2,
            key_dim=1,
            value_dim=1,
            num_value_heads=2,
            dtype="bfloat16",
            chunk_size=128,
            cu_seqlens=(0, 32, 61),
            traced_cu_seqlens=True,
            initial_state=True,
            seed=1556,
        ),
    ),
    # OPEN: K = 1, weak decays, float32, chunk 64. dA_log (0.0148) is the sum of three paths of the chunked
    # backward that cancel about 500x: through Aqk (-3.44), through Akk and the inverse (+3.77), through
    # the decays (-0.31); the recurrent form cancels 17x. Each path is within 1-3 ulp of float32, so dA_log
    # and ddt_bias carry ~1e-4 of their size: chunk 1.7e-4, xla 1.1e-4 over the 1e-4 bound (recurrent
    # 1.2e-6; K = 8 gives 7e-7). The error has either sign over nearby inputs and grows with the chunk
    # (xla: 1.1e-5 at 16, 4.8e-5 at 32, 1.45e-4 at 64): the float32 limit of this within-chunk form
    # (FLA's), which shorter within-chunk blocks would lower. Not strict: the xla error sits near the bound.
    *(
        _case(
            "K1-weak-dA_log-bias",
            op_impl,
            Spec(
                "kda",
                seq_len=64,
                key_dim=1,
                value_dim=128,
                num_value_heads=1,
                gate="weak",
                initial_state=True,
                output_final_state=True,
                use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True,
                seed=35,
            ),
            known_bug="chunked kda backward paths cancel ~500x at K = 1: dA_log/ddt_bias off by 1.1-1.7e-4",
        )
        for op_impl in ("kda-chunk", "kda-xla")
    ),
]


# A NaN in k or v at step t must not reach earlier steps. Chunked forms multiply masked (zero) scores
# with the NaN row of v (0 * NaN = NaN) unless they mask values too: a NaN in the middle of the second
# chunk (step 21 of chunks of 16), in k and in v, for every chunked implementation.
def _nan_cases(op_impl: str, **spec_options):
    op = op_impl.split("-")[0]
    spec = Spec(op, seq_len=40, key_dim=8, value_dim=8, chunk_size=16, output_final_state=True, **spec_options)
    return [
        _case(f"nan-mid-chunk-{tensor}", op_impl, spec, Poison(tensor, batch_row=0, step=21, head=0, dim=3))
        for tensor in ("k", "v")
    ]


NAN_CASES = [
    *_nan_cases("simple_gla-xla"),
    *_nan_cases("simple_gla-chunk"),
    *_nan_cases("simple_gla-fused_chunk"),
    *_nan_cases("simple_gla-fused_g_gamma", gates=("g_gamma",)),
    *_nan_cases("gla-xla"),
    *_nan_cases("gla-chunk"),
    *_nan_cases("kda-xla"),
    *_nan_cases("kda-chunk"),
    # The gla xla forward garbage above, met by the NaN property: the clean run itself is garbage / NaN.
    _case(
        "nan-forward-alone-garbage",
        "gla-xla",
        Spec(
            "gla",
            seq_len=170,
            num_heads=2,
            key_dim=256,
            value_dim=100,
            dtype="bfloat16",
            chunk_size=16,
            gate="mixed",
            cu_seqlens=(0, 16, 169, 170),
            traced_cu_seqlens=True,
            initial_state=True,
            output_final_state=True,
            seed=108,
        ),
        Poison("k", batch_row=0, step=110, head=0, dim=2),
    ),
    # gla chunk: a NaN in k or v sent its whole grid step to the exact level products, so the earlier
    # rows of the step (in range for the anchored products in the clean run) changed by rounding.
    _case(
        "nan-anchored-step-rounding",
        "gla-chunk",
        Spec(
            "gla",
            seq_len=38,
            key_dim=100,
            value_dim=128,
            chunk_size=128,
            gate="zero",
            cu_seqlens=(0, 10, 10, 38, 38),
            traced_cu_seqlens=True,
            output_final_state=True,
            seed=2068,
        ),
        Poison("k", batch_row=0, step=29, head=0, dim=20),
    ),
    _case(
        "nan-v-anchored-step-rounding",
        "gla-chunk",
        Spec("gla", seq_len=100, key_dim=40, value_dim=24, chunk_size=32, gate="log_sigmoid", seed=7),
        Poison("v", batch_row=0, step=45, head=1, dim=3),
    ),
    # gla chunk: the masked outputs of an in-range step were formed only when its end state came out
    # non-finite; a hard reset after the NaN v_34 left the state finite, and the unmasked product had
    # carried the NaN into rows 0-33 of its column.
    _case(
        "nan-v-dropped-by-a-reset",
        "gla-chunk",
        Spec(
            "gla",
            seq_len=64,
            num_heads=2,
            key_dim=64,
            value_dim=130,
            dtype="bfloat16",
            gate="weak",
            resets=1,
            cu_seqlens=(0, 51, 64, 64),
            traced_cu_seqlens=True,
            initial_state=True,
            output_final_state=True,
            seed=636,
        ),
        Poison("v", batch_row=0, step=34, head=0, dim=92),
    ),
]


@pytest.mark.parametrize("name, spec", ORACLE_CASES)
def test_matches_oracle(name, spec):
    properties.check_matches_oracle(spec, find_implementation(spec.op, name))


@pytest.mark.parametrize("name, spec, poison", NAN_CASES)
def test_nan_stays_causal(name, spec, poison):
    properties.check_nan_stays_causal(spec, poison, find_implementation(spec.op, name))
