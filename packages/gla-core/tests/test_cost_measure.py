"""gla_core.cost_measure: the memory gate, and one problem's pipeline (stub, probes, full-shape compiles)
on fake compile jobs; then a tiny program end to end on a compile-only TPU."""

from __future__ import annotations

import threading
import time

import pytest

from gla_core import cost_measure
from gla_core.cost import attention_problem, program_spec
from gla_core.cost_scaling import MEMORY_MARGIN
from gla_core.errors import InvalidArgumentError
from gla_core.static_profile import KernelCall, KernelProfile, ProgramProfile, StubbedProgram

GIB = 2**30
BLOCKS = ("(None, None, 512, 128)",)
# cycles = 1000 + per_token * tokens; a fake compile takes 1 GiB + 1 KiB per cycle.
PER_TOKEN = {"small": 10, "large": 1000}
GLA = attention_problem("gla", 2, 4096, 16)


def _cycles(name: str, tokens: int) -> int:
    return 1000 + PER_TOKEN[name] * tokens


def _calls(tokens: int) -> tuple[KernelCall, ...]:
    return tuple(KernelCall(name, (tokens // 512,), BLOCKS) for name in PER_TOKEN)


class FakeJobs:
    """Fake stub and kernel jobs: every spec makes the calls `small` and `large` (traced from T=512 on,
    so the probes are T=512 and 1024); a compile's peak is 1 GiB + 1 KiB per cycle. Records every
    program a kernel job compiles kernels of as (tokens, memory limit, kernels compiled). `fail`:
    kernel name -> (tokens at which its compile fails, whether for memory)."""

    def __init__(self):
        self.jobs: list[tuple[int, int, list[str]]] = []
        self.fail: dict[str, tuple[set[int], bool]] = {}

    def stub_programs(self, specs, chip, probes=(), memory_limit=None):
        profile = ProgramProfile(chip, {}, (), 100, 100, 5, pallas_calls=2)
        stubbed = []
        for spec, candidates in zip(specs, probes, strict=True):
            lengths = [c["seq_len"] for c in candidates]
            pairs = [j for j, t in enumerate(lengths[:-1]) if t >= 512]
            stubbed.append(StubbedProgram(profile, _calls(spec["batch"] * spec["seq_len"]), min(pairs, default=None)))
        return stubbed

    def profile_kernels(self, specs, chip, only=None, memory_limit=None):
        result = []
        for p, spec in enumerate(specs):
            tokens = spec["batch"] * spec["seq_len"]
            kernels = []
            for k, name in enumerate(PER_TOKEN):
                if only is not None and (p, k) not in only:
                    continue
                failing, over_memory = self.fail.get(name, (set(), False))
                if tokens in failing:
                    kernels.append(KernelProfile(k, name, 0, 0, error="aborted", over_memory=over_memory))
                    continue
                cycles = _cycles(name, tokens)
                kernels.append(KernelProfile(k, name, cycles, 4096, 1.0, GIB, GIB + 1024 * cycles))
            if kernels:
                self.jobs.append((tokens, memory_limit, [k.name for k in kernels]))
            result.append(kernels)
        return result


@pytest.fixture
def fake_jobs(monkeypatch) -> FakeJobs:
    jobs = FakeJobs()
    monkeypatch.setattr(cost_measure, "stub_programs", jobs.stub_programs)
    monkeypatch.setattr(cost_measure, "profile_kernels", jobs.profile_kernels)
    return jobs


def _measure_forward(full_budget: int = 4 * GIB) -> cost_measure.ProgramRow:
    program = cost_measure.Program(program_spec(GLA, "fwd"), "fwd", "chunk", False)
    gate = cost_measure.MemoryGate(2, 8 * GIB)
    (row,) = cost_measure._Pipeline(GLA, [program], "v6e", gate, full_budget).run(clock_hz=1e9)
    return row


def test_pipeline_scales_from_probes_and_compiles_at_full_shape_what_fits(fake_jobs):
    row = _measure_forward()
    small, large = row.kernels
    # Probes at B=1 T=512 and 1024; only `small` (1 GiB + 2 * 81 MiB predicted) fits a 4 GiB full-shape compile.
    assert [(tokens, names) for tokens, _, names in fake_jobs.jobs] == [
        (512, ["small", "large"]),
        (1024, ["small", "large"]),
        (8192, ["small"]),
    ]
    assert (small.method, small.cycles, small.scaled) == ("full", _cycles("small", 8192), _cycles("small", 8192))
    assert small.compile_bytes == GIB + 1024 * _cycles("small", 8192) < small.predicted_bytes  # measured, predicted
    assert (large.method, large.cycles) == ("scaled", _cycles("large", 8192))
    assert large.probes == ((512, _cycles("large", 512)), (1024, _cycles("large", 1024)))
    assert large.compile_bytes == 0 and large.predicted_bytes > 4 * GIB
    assert large.note == "its full-shape compile is predicted to take 16.6 GiB, over the 4 GiB budget"
    assert (row.argument_bytes, row.output_bytes, row.temp_bytes) == (100, 100, 5) and large.steps == 16
    # The probes are one job; the full-shape job reserves what the larger probe predicts.
    assert fake_jobs.jobs[0][1] == fake_jobs.jobs[1][1] == cost_measure.PROBE_RESERVE
    assert fake_jobs.jobs[2][1] == pytest.approx(GIB + MEMORY_MARGIN * 1024 * _cycles("small", 8192))


def test_a_full_shape_budget_of_zero_scales_every_kernel(fake_jobs):
    row = _measure_forward(full_budget=0)
    assert [k.method for k in row.kernels] == ["scaled", "scaled"] and len(fake_jobs.jobs) == 2


def test_a_kernel_killed_for_memory_is_compiled_again_alone_with_the_whole_budget(fake_jobs):
    fake_jobs.fail["small"] = ({8192}, True)
    row = _measure_forward()
    assert [(tokens, limit) for tokens, limit, _ in fake_jobs.jobs[2:]] == [
        (8192, fake_jobs.jobs[2][1]),
        (8192, 4 * GIB),
    ]
    assert row.kernels[0].method == "scaled" and "full-shape compile failed (aborted)" in row.kernels[0].note


def test_a_kernel_whose_probe_fails_is_not_compiled_again(fake_jobs):
    fake_jobs.fail["small"] = ({1024}, False)
    row = _measure_forward()
    assert [names for _, _, names in fake_jobs.jobs] == [["small", "large"], ["small", "large"]]
    small = row.kernels[0]
    assert (small.method, small.cycles, small.note) == ("failed", 0, "its probe compile failed (aborted)")
    assert not row.complete


def test_a_probe_killed_for_memory_is_compiled_again_with_the_whole_memory_budget(fake_jobs):
    fake_jobs.fail["small"] = ({1024}, True)
    row = _measure_forward()
    assert fake_jobs.jobs[2] == (1024, 8 * GIB, ["small"])  # the memory budget of `_measure_forward`'s gate
    assert row.kernels[0].method == "failed"  # the fake fails it again


def test_a_program_without_probe_length_is_compiled_at_the_full_shape(fake_jobs):
    problem = attention_problem("gla", 1, 1024, 16)  # probes must be shorter: T=512 and 1024 are not
    program = cost_measure.Program(program_spec(problem, "fwd"), "fwd", "chunk", False)
    gate = cost_measure.MemoryGate(2, 8 * GIB)
    (row,) = cost_measure._Pipeline(problem, [program], "v6e", gate, 0).run(clock_hz=1e9)
    assert fake_jobs.jobs == [(1024, 8 * GIB, ["small", "large"])]
    assert [(k.method, k.probes) for k in row.kernels] == [("full", ()), ("full", ())]


def test_the_full_shape_budget_is_at_most_the_memory_budget():
    with pytest.raises(InvalidArgumentError, match="full_shape_budget: expected 0 to the memory budget"):
        cost_measure.measure([GLA], ["v6e"], memory_budget=4 * GIB, full_shape_budget=5 * GIB)


def _run_jobs(gate: cost_measure.MemoryGate, sizes: list[int], hold: float = 0.02) -> list[tuple[int, int, int]]:
    """Runs a job per size through `gate`, started in order; returns (size, jobs running, memory
    reserved) as each job starts."""
    running, seen = [], []
    lock = threading.Lock()

    def job(size: int):
        def work(limit: int):
            with lock:
                running.append(limit)
                seen.append((size, len(running), sum(running)))
            time.sleep(hold)
            with lock:
                running.remove(limit)

        gate.run(size, work)

    threads = [threading.Thread(target=job, args=(size,)) for size in sizes]
    for thread in threads:
        thread.start()
        time.sleep(0.002)
    for thread in threads:
        thread.join()
    return seen


def test_memory_gate_keeps_jobs_and_memory_within_bounds():
    seen = _run_jobs(cost_measure.MemoryGate(jobs=2, budget=10), [6, 6, 3, 3, 12])
    assert all(count <= 2 and reserved <= 10 for _, count, reserved in seen)
    assert (12, 1, 10) in seen  # above the budget: reserves all of it, alone


def test_memory_gate_admits_the_largest_waiting_job_first():
    gate = cost_measure.MemoryGate(jobs=1, budget=10)
    seen = _run_jobs(gate, [1, 2, 5, 3], hold=0.05)  # 1 runs while the others queue up
    assert [size for size, _, _ in seen] == [1, 5, 3, 2]


@pytest.mark.tpu_compile
def test_measure_a_tiny_program_end_to_end():
    problem = attention_problem("simple_gla", 1, 2048, 2)  # probes T=512 and 1024 (blocks of 512 tokens)
    program = cost_measure.Program(program_spec(problem, "fwd"), "fwd", "chunk", False)
    gate = cost_measure.MemoryGate(2, 4 * GIB)
    start = time.monotonic()
    (row,) = cost_measure._Pipeline(problem, [program], "v6e", gate, 4 * GIB).run(clock_hz=1.9e9)
    print(f"\n{row.label} fwd in {time.monotonic() - start:.0f} s: {row.seconds * 1e6:.1f} us static")
    assert row.complete and row.floor_bytes > 0 and row.kernels
    for kernel in row.kernels:
        print(f"  {kernel}")
        assert kernel.method == "full" and kernel.cycles > 0 and kernel.vmem_bytes > 0
        assert kernel.probes and kernel.scaled > 0 and kernel.compile_bytes > 0


def test_programs_of_the_peers_only(monkeypatch):
    """`ours=False` (gla cost --peers-only): the forward and training step of each installed peer, none of ours."""
    from gla_core import cost_peers

    monkeypatch.setattr(cost_peers.Peer, "installed", lambda peer: True)
    problem = attention_problem("kda", 1, 2048, 4)
    peers = [peer.name for peer in cost_peers.peers_of("kda")]
    programs = cost_measure.programs_of(problem, with_peers=True, ours=False)
    assert [(p.implementation, p.stage, p.peer) for p in programs] == [
        (name, stage, True) for name in peers for stage in cost_measure.STAGES
    ]
    assert cost_measure.programs_of(problem, with_peers=False, ours=False) == []
    assert not any(p.peer for p in cost_measure.programs_of(problem, with_peers=False))
