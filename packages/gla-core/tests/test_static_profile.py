"""gla_core.pallas_jaxpr and gla_core.static_profile: finding the Pallas calls of a program, replacing
them with empty kernels, and profiling a program kernel by kernel for a compile-only TPU."""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from gla_core import static_profile
from gla_core.pallas_jaxpr import STUB_NAME, pallas_equations, stub_kernels

ROWS, LANES = 256, 128
STRUCT = jax.ShapeDtypeStruct((ROWS, LANES), jnp.float32)


def _scaled(factor: float, name: str):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * factor

    def call(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), name=name)(x)

    return call


@jax.custom_vjp
def _with_vjp(x):
    return _scaled(3.0, "forward")(x)


def _with_vjp_fwd(x):
    return _with_vjp(x), None


def _with_vjp_bwd(_, g):
    return (_scaled(3.0, "backward")(g),)


_with_vjp.defvjp(_with_vjp_fwd, _with_vjp_bwd)


def _program(x):
    """Three Pallas calls: one at top level, one in a nested jit, one inside a scan body."""
    y = _scaled(2.0, "first")(x)
    y = jax.jit(_scaled(0.5, "second"))(y)
    y, _ = jax.lax.scan(lambda carry, _: (_scaled(1.0, "third")(carry), None), y, None, length=2)
    return jnp.sin(y)


def _names(eqns) -> list[str]:
    return [eqn.params["name"] for eqn in eqns]


def test_pallas_equations_are_found_in_nested_jaxprs_in_program_order():
    closed = jax.make_jaxpr(_program)(STRUCT)
    assert _names(pallas_equations(closed.jaxpr)) == ["first", "second", "third"]


def test_pallas_equations_of_a_custom_vjp_training_step():
    closed = jax.make_jaxpr(jax.grad(lambda x: _with_vjp(x).sum()))(STRUCT)
    assert _names(pallas_equations(closed.jaxpr)) == ["forward", "backward"]


def test_stub_kernels_keep_every_operand_and_result_and_do_no_work():
    closed = jax.make_jaxpr(_program)(STRUCT)
    stubbed = stub_kernels(closed)
    before, after = pallas_equations(closed.jaxpr), pallas_equations(stubbed.jaxpr)
    assert _names(after) == [STUB_NAME] * len(before)
    for real, stub in zip(before, after, strict=True):
        assert [v.aval for v in stub.invars] == [v.aval for v in real.invars]
        assert [v.aval for v in stub.outvars] == [v.aval for v in real.outvars]
    assert stubbed.out_avals == closed.out_avals
    # The original program is left as it was.
    assert _names(pallas_equations(closed.jaxpr)) == ["first", "second", "third"]


def _calls(block: int, steps: int) -> tuple[static_profile.KernelCall, ...]:
    blocks = (f"(None, None, {block}, 128)",)
    names = ("chunk_fwd", "chunk_bwd")
    return tuple(static_profile.KernelCall(name, (1, 16, steps), blocks) for name in names)


def test_same_kernels_compares_names_and_blocks_not_grids():
    assert static_profile.same_kernels(_calls(512, 16), _calls(512, 1))
    assert not static_profile.same_kernels(_calls(512, 16), _calls(256, 16))
    assert not static_profile.same_kernels(_calls(512, 16), _calls(512, 16)[:1])


def test_the_first_matching_probe_pair_traces_only_what_it_needs():
    # Candidates T = 128, 256, 512, 1024, 2048 with blocks of min(T, 512) tokens: 512 and 1024 match.
    candidates = [_calls(min(t, 512), max(1, t // 512)) for t in (128, 256, 512, 1024, 2048)]
    asked = []
    calls_of = lambda j: asked.append(j) or candidates[j]
    assert static_profile.first_matching_pair(_calls(512, 16), calls_of, len(candidates)) == 2
    assert asked == [0, 1, 2, 3]
    untraceable = lambda j: None if j == 3 else candidates[j]  # 1024 does not trace: (2048, -) is no pair
    assert static_profile.first_matching_pair(_calls(512, 16), untraceable, len(candidates)) is None


def test_a_probe_pair_must_grow_the_grid():
    """T = 128 and 256 both pad to one block of 256 tokens: the same grid gives no slope, so the first
    pair is (256, 512)."""
    candidates = [_calls(256, steps) for steps in (1, 1, 2, 4)]
    assert static_profile.first_matching_pair(_calls(256, 16), lambda j: candidates[j], len(candidates)) == 1
    assert static_profile.first_matching_pair(_calls(256, 16), lambda j: candidates[j], 2) is None


def test_a_zero_cycle_estimate_is_a_failure_not_a_free_kernel():
    assert "error" not in static_profile.kernel_measurement(1200, 4096, seconds=1.0)
    failed = static_profile.kernel_measurement(0, 4096, seconds=1.0)
    assert failed["error"] == static_profile.NO_ESTIMATE
    assert (failed["cycles"], failed["seconds"]) == (0, 1.0)


def test_kernel_name_drops_the_uniquifying_suffix():
    assert static_profile.kernel_name("chunk_fwd.12") == "chunk_fwd"
    assert static_profile.kernel_name("chunk_fwd") == "chunk_fwd"


def test_with_kernels_sums_cycles_and_keeps_the_largest_scoped_vmem():
    whole = static_profile.ProgramProfile("v6e", {}, (), 100, 50, 7)
    alone = [
        static_profile.KernelProfile(0, "fwd", 10, 4096),
        static_profile.KernelProfile(1, "fwd", 5, 8192),
        static_profile.KernelProfile(2, "bwd", 20, 1024),
    ]
    merged = static_profile.with_kernels(whole, alone)
    assert merged.kernel_cycles == {"fwd": 15, "bwd": 20} and merged.pallas_cycles == 35
    assert merged.kernel_vmem == {"fwd": 8192, "bwd": 1024}
    assert (merged.argument_bytes, merged.output_bytes, merged.temp_bytes) == (100, 50, 7)


def test_profile_round_trips_through_json():
    profile = static_profile.ProgramProfile(
        "v6e",
        {"fwd": 10},
        (static_profile.XlaOp("copy.1", "copy", 64, 3),),
        100,
        50,
        7,
        kernel_vmem={"fwd": 4096},
        pallas_calls=1,
    )
    assert static_profile.ProgramProfile.from_json(profile.to_json()) == profile


# A compiled program's entry computation: a Mosaic call, a transpose XLA writes to HBM, a prefetch into
# on-chip memory (S(1)), free ops, and an asynchronous copy whose output is the larger element.
MOSAIC = 'custom_call_target="tpu_custom_call", backend_config={"used_scoped_memory_configs":[{"size":"65536"}]}'
HLO = """HloModule jit_step

%fused (p: f32[8]) -> f32[8] {
  ROOT %p = f32[8]{0} parameter(0)
}

ENTRY %main (a: bf16[2,64,128], b: f32[16,128]) -> (bf16[2,64,128], f32[16,128]) {
  %a = bf16[2,64,128]{2,1,0} parameter(0)
  %b = f32[16,128]{1,0} parameter(1)
  %chunk_fwd.3 = bf16[2,64,128]{2,1,0} custom-call(%a), {MOSAIC}
  %transpose.1 = bf16[2,128,64]{2,1,0} transpose(%chunk_fwd.3), dimensions={0,2,1}
  %copy-start = (f32[16,128]{1,0:S(1)}, f32[16,128]{1,0}, u32[]) copy-start(%b)
  %copy-start.2 = (f32[16,128]{1,0}, f32[32,128]{1,0}, u32[]) copy-start(%b)
  %gte = f32[16,128]{1,0} get-tuple-element(%copy-start), index=0
  ROOT %tuple = (bf16[2,64,128]{2,1,0}, f32[16,128]{1,0}) tuple(%chunk_fwd.3, %gte)
}
""".replace("{MOSAIC}", MOSAIC)


def test_profile_from_joins_compiled_hlo_and_static_cycles():
    cycles = {"chunk_fwd.3": 900, "transpose.1": 40, "copy-start": 7, "copy-start.2": 5, "p": 1}
    memory = {"argument_bytes": 100, "output_bytes": 60, "temp_bytes": 8}
    profile = static_profile.profile_from(HLO, cycles, memory, "v6e", pallas_calls=1)
    assert profile.kernel_cycles == {"chunk_fwd": 900} and profile.kernel_vmem == {"chunk_fwd": 65536}
    # The prefetch into S(1) writes no HBM; the other copy writes its larger element, f32[32,128].
    assert [(op.name, op.bytes_written, op.cycles) for op in profile.xla_ops] == [
        ("transpose.1", 2 * 128 * 64 * 2, 40),
        ("copy-start.2", 32 * 128 * 4, 5),
    ]
    assert profile.xla_cycles == 45 and profile.xla_bytes == 2 * 128 * 64 * 2 + 32 * 128 * 4
    assert (profile.argument_bytes, profile.output_bytes, profile.temp_bytes, profile.pallas_calls) == (100, 60, 8, 1)


def test_parse_profiles_sums_cycles_per_op_over_the_profiles_written(tmp_path):
    entry = 'hlo_op_estimate {{\n  hlo_op_name: "{}"\n  estimated_cycles: {}\n}}\n'
    (tmp_path / "chunk_fwd.1_static_llo_profile.textproto").write_text(entry.format("chunk_fwd.1", 15010))
    (tmp_path / "main_static_llo_profile.textproto").write_text(
        entry.format("copy", 3) + entry.format("chunk_fwd.1", 5)
    )
    (tmp_path / "unrelated.txt").write_text(entry.format("copy", 1000))
    assert static_profile.parse_profiles(tmp_path) == {"chunk_fwd.1": 15015, "copy": 3}


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_watched_job_is_killed_past_its_memory_or_time(tmp_path):
    log = tmp_path / "out.log"
    grow = "import time; block = bytearray(300 * 2**20); block[::4096] = b'x' * len(block[::4096]); time.sleep(30)"
    why, over_memory = static_profile._run_watched(_python(grow), {}, log, timeout=60, memory_limit=100 * 2**20)
    assert over_memory and "over its reservation of 0.1 GiB" in why
    why, over_memory = static_profile._run_watched(_python("import time; time.sleep(30)"), {}, log, 1.0, None)
    assert not over_memory and "over its time limit" in why
    why, _ = static_profile._run_watched(_python("raise SystemExit('Error: no such kernel')"), {}, log, 60, None)
    assert why == "exit code 1: Error: no such kernel"
    assert static_profile._run_watched(_python("pass"), {}, log, 60, None) == ("", False)


def test_a_kernels_job_resumes_after_the_kernel_that_killed_it(monkeypatch):
    """The fake subprocess compiles kernels 0, 1, 2 of program 0 in order; kernel 1 aborts it once."""
    runs = []

    def run_watched(command, env, log, timeout, memory_limit):
        job, out = json.loads(command[3]), pathlib.Path(command[4])
        runs.append(job["skip"])
        for kernel in (k for k in range(3) if [0, k] not in job["skip"]):
            record = {"program": 0, "kernel": kernel, "name": f"k{kernel}"}
            with open(out / "started.jsonl", "a") as stream:
                stream.write(json.dumps(record) + "\n")
            if kernel == 1:
                return "killed at 3.0 GiB resident, over its reservation of 2.0 GiB", True
            with open(out / "results.jsonl", "a") as stream:
                stream.write(json.dumps({**record, "cycles": 10, "vmem_bytes": 1}) + "\n")
        return "", False

    monkeypatch.setattr(static_profile, "_run_watched", run_watched)
    records = static_profile.run_job({"mode": "kernels", "chip": "v6e", "programs": [{}]}, memory_limit=2 * 2**30)
    assert runs == [[], [[0, 0], [0, 1]]]
    by_kernel = {r["kernel"]: r for r in records}
    assert by_kernel[0]["cycles"] == by_kernel[2]["cycles"] == 10
    assert by_kernel[1]["over_memory"] and "over its reservation" in by_kernel[1]["error"]


def test_a_failed_stub_or_whole_job_raises(monkeypatch):
    monkeypatch.setattr(static_profile, "_run_watched", lambda *args: ("exit code 1: Error: x", False))
    with pytest.raises(static_profile.ProfileError, match="stub compile failed: exit code 1: Error: x"):
        static_profile.run_job({"mode": "stub", "chip": "v6e", "programs": [{}]})


def test_failure_names_the_check_that_failed():
    output = (
        "WARNING: TPU_WORKER_HOSTNAMES Error: ignore\nF1127 12:26:49.201876   24781 a.cc:66] Check failed: n > 0\n*** x"
    )
    assert static_profile._failure(output) == "Check failed: n > 0"
    assert static_profile._failure("a\nb\nc\nd") == "b | c | d"


@pytest.mark.tpu_compile
@pytest.mark.parametrize("chip", ["v6e", "v5e"])
def test_profile_by_kernel_of_a_small_forward(chip):
    """On v5e this bfloat16 program's profile aborted in libtpu's LLO type check until the profiles ran
    with it off (`NO_TYPE_CHECK_FLAG`)."""
    spec = {
        "program": "attention",
        "op": "simple_gla",
        "batch": 1,
        "seq_len": 256,
        "heads": 2,
        "gate": "g",
        "impl": "chunk",
        "stage": "fwd",
        "chip": chip,
    }
    profile = static_profile.profile_by_kernel(spec)
    assert profile.pallas_calls >= 1
    assert set(profile.kernel_cycles) == set(profile.kernel_vmem)
    assert all(cycles > 0 for cycles in profile.kernel_cycles.values())
    assert all(vmem > 0 for vmem in profile.kernel_vmem.values())
    assert profile.argument_bytes > 0 and profile.output_bytes > 0
