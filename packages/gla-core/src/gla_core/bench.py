"""`gla bench`: every implementation that runs on this backend, side by side, per op.

Times the forward and the forward + backward of each accepting implementation at the same
shapes (B=1, H=4, K=V=128, f32, T in `--seq-lens`), prints a table with each time relative
to the fastest implementation of that (op, T, pass), and optionally plots time against T.
The pytest-benchmark files (`nox -s bench`) measure the same things for the record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from gla_core.dispatch import dispatch, explain
from gla_core.progress import progress
from gla_core.registry import default_registry
from gla_core.timing import forward_backward_seconds, forward_seconds

DEFAULT_SEQ_LENS = (1024, 4096)
PROBLEM = dict(batch=1, num_heads=4, key_dim=128, value_dim=128)
OP_OPTIONS = {"simple_gla": dict(gates=("g",)), "gla": {}, "kda": {}, "kda_gate": {}}


@dataclasses.dataclass(frozen=True)
class Timing:
    op: str
    seq_len: int
    stage: str  # "fwd" or "fwd+bwd"
    implementation: str
    seconds: float


def _case(op: str, seq_len: int):
    from gla_ref.testing import make_case

    options = dict(PROBLEM, seq_len=seq_len, **OP_OPTIONS[op])
    if op == "kda_gate":
        options.pop("value_dim")
    return make_case(op, **options)


def _accepting(op: str, case, skip: Sequence[str]) -> list[str]:
    resolution = explain(op, **case.kwargs())
    return [c.implementation.name for c in resolution.candidates if c.accepted and c.implementation.name not in skip]


def run_bench(ops: Sequence[str] | None = None, seq_lens: Sequence[int] = DEFAULT_SEQ_LENS, skip=()) -> list[Timing]:
    """Times every accepting implementation of each op at each T, forward and forward + backward."""
    jobs = []
    for op in ops if ops is not None else default_registry().ops():
        for seq_len in seq_lens:
            case = _case(op, seq_len)
            jobs.extend((op, seq_len, case, name) for name in _accepting(op, case, skip))
    timings = []
    for op, seq_len, case, name in progress(jobs, len(jobs), label=lambda job: f"{job[0]} T={job[1]} {job[3]}"):
        fn = lambda _op=op, _name=name, **kwargs: dispatch(_op, impl=_name, **kwargs)
        timings.append(Timing(op, seq_len, "fwd", name, forward_seconds(fn, case.inputs, case.options)))
        seconds = forward_backward_seconds(fn, case.inputs, case.options, case.differentiable)
        timings.append(Timing(op, seq_len, "fwd+bwd", name, seconds))
    return timings


def format_timings(timings: Sequence[Timing]) -> str:
    """One block per (op, T, stage): implementations fastest first, with the ratio to the fastest."""
    groups: dict[tuple, list[Timing]] = {}
    for timing in timings:
        groups.setdefault((timing.op, timing.seq_len, timing.stage), []).append(timing)
    lines = [f"{'op':<11} {'T':>6} {'stage':<8} {'implementation':<16} {'time':>10} {'vs fastest':>10}"]
    for (op, seq_len, stage), group in groups.items():
        fastest = min(t.seconds for t in group)
        for t in sorted(group, key=lambda t: t.seconds):
            ratio = f"{t.seconds / fastest:.2f}x"
            lines.append(
                f"{op:<11} {seq_len:>6} {stage:<8} {t.implementation:<16} {t.seconds * 1e3:>7.1f} ms {ratio:>10}"
            )
    return "\n".join(lines)


def plot_timings(timings: Sequence[Timing], path: str) -> None:
    """Time against T per implementation, one panel per (op, stage); needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit(f"--plot needs matplotlib: pip install 'gla-core[plot]' ({error})") from error
    order = default_registry().ops()
    panels = sorted({(t.op, t.stage) for t in timings}, key=lambda p: (order.index(p[0]), p[1]))
    figure, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5), squeeze=False)
    for axis, (op, stage) in zip(axes[0], panels, strict=True):
        for name in sorted({t.implementation for t in timings if (t.op, t.stage) == (op, stage)}):
            points = sorted(
                (t.seq_len, t.seconds * 1e3) for t in timings if (t.op, t.stage, t.implementation) == (op, stage, name)
            )
            axis.plot(*zip(*points, strict=True), marker="o", label=name)
        axis.set(title=f"{op} {stage}", xlabel="T", ylabel="ms", xscale="log", yscale="log")
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
