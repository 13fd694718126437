"""The `gla` command: `gla list`, `gla explain`, `gla demo`, `gla bench`, `gla cost`."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
import threading
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from gla_core.dispatch import explain
from gla_core.errors import GlaError
from gla_core.ops import DEFAULT_CHUNK_SIZE
from gla_core.overrides import use
from gla_core.registry import default_registry

GIB = 2**30


def _table(header: Sequence[str], rows: list[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _backends(implementation) -> str:
    names = ",".join(sorted(implementation.backends))
    return names + (" (+interpret)" if implementation.interpretable else "")


def command_list(args: argparse.Namespace) -> int:
    """Prints every registered implementation, and the plugins that failed or were skipped."""
    registry = default_registry()
    rows = [(i.op, i.name, i.package, str(i.priority), _backends(i), i.description) for i in registry.implementations()]
    print(_table(("op", "implementation", "package", "priority", "backends", "description"), rows))
    missing = [op for op in registry.ops() if not registry.implementations(op)]
    if missing:
        print(f"\nops without implementation: {', '.join(missing)}")
    for failure in registry.failures:
        print(f"\nplugin {failure.plugin!r} failed to load and was skipped: {failure.error}")
    if registry.skipped:
        print(f"\nplugins not loaded (not in GLA_PLUGINS): {', '.join(registry.skipped)}")
    return 0


DEFAULT_EXPLAIN_BATCH = 2


def _shape_structs(args: argparse.Namespace) -> tuple[tuple, dict]:
    """ShapeDtypeStructs for `gla explain` from the command-line shape options."""
    dtype = jnp.dtype(args.dtype)
    s = lambda *shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt)
    b, t, h, k, v = args.batch, args.seq_len, args.heads, args.key_dim, args.value_dim
    if b is None:
        b = 1 if args.varlen is not None else DEFAULT_EXPLAIN_BATCH
    hv = args.value_heads or h
    kwargs: dict = {"chunk_size": args.chunk_size, "output_final_state": args.ht}
    n = b
    if args.varlen is not None:
        kwargs["cu_seqlens"] = s(args.varlen + 1, dt=jnp.int32)
        n = args.varlen
    if args.op == "kda_gate":
        kwargs = {"A_log": s(hv, dt=jnp.float32)}
        if args.dt_bias:
            kwargs["dt_bias"] = s(hv * k, dt=jnp.float32)
        if args.lower_bound is not None:
            kwargs["lower_bound"] = args.lower_bound
        return (s(b, t, hv, k),), kwargs
    if args.h0:
        kwargs["initial_state"] = s(n, hv if args.op == "kda" else h, k, v, dt=jnp.float32)
    if args.op == "simple_gla":
        for gate in args.gates.split(",") if args.gates else ():
            kwargs[gate] = s(b, t, h) if gate == "g" else s(h)
        return (s(b, t, h, k), s(b, t, h, k), s(b, t, h, v)), kwargs
    if args.op == "gla":
        kwargs["gk"] = s(b, t, h, k)
        return (s(b, t, h, k), s(b, t, h, k), s(b, t, h, v)), kwargs
    kwargs.update(g=s(b, t, hv, k), beta=s(b, t, hv), use_qk_l2norm_in_kernel=args.l2norm)
    if args.gate_in_kernel:
        kwargs.update(use_gate_in_kernel=True, A_log=s(hv, dt=jnp.float32))
        if args.dt_bias:
            kwargs["dt_bias"] = s(hv * k, dt=jnp.float32)
        if args.lower_bound is not None:
            kwargs["lower_bound"] = args.lower_bound
    return (s(b, t, h, k), s(b, t, h, k), s(b, t, hv, v)), kwargs


def command_explain(args: argparse.Namespace) -> int:
    """Prints every candidate for the described call, accepted or declined, and the winner."""
    arrays, kwargs = _shape_structs(args)
    with use(backend=args.backend, interpret=args.interpret or None):
        resolution = explain(args.op, *arrays, **kwargs)
    print(resolution)
    return 0 if resolution.winner is not None else 1


def command_demo(args: argparse.Namespace) -> int:
    """Runs every installed op through dispatch, checked against the float64 oracle."""
    from gla_core.demo import run_demo

    print(f"gla demo on backend {jax.default_backend()} ({jax.devices()[0].device_kind})", flush=True)
    table, passed = run_demo(run_all=args.all, timing=not args.no_timing, ops=tuple(args.op) if args.op else None)
    print(table)
    print("\nall checks passed" if passed else "\nSOME CHECKS FAILED (see rows marked FAIL)")
    return 0 if passed else 1


class MissingExtraError(GlaError, RuntimeError):
    """An option needs a package that is not installed (checked before any work starts)."""


def _require(module: str, purpose: str, install: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(f"{purpose} needs {module}, which is not installed: {install}")


def command_bench(args: argparse.Namespace) -> int:
    """Times every implementation that runs here, side by side."""
    from gla_core.bench import format_timings, plot_timings, run_bench

    if args.plot:
        _require("matplotlib", "--plot", "pip install 'gla-core[plot]'")

    print(f"gla bench on backend {jax.default_backend()}: B=1 H=4 K=V=128 float32", flush=True)
    timings = run_bench(
        ops=tuple(args.op or default_registry().ops()), seq_lens=tuple(args.seq_lens), skip=tuple(args.skip or ())
    )
    print(format_timings(timings))
    if args.plot:
        plot_timings(timings, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _installed_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def command_cost(args: argparse.Namespace) -> int:
    """Compiles every program of the cost report for compile-only TPU devices and writes the report."""
    from gla_core import cost_store
    from gla_core.cost import production_problems, small_problems
    from gla_core.cost_decode import DECODE_OPS, measure_decode
    from gla_core.cost_measure import DEFAULT_JOBS, measure
    from gla_core.cost_peers import PEER_OPS
    from gla_core.cost_report import render
    from gla_core.static_profile import calibrate_clock

    _require("libtpu", "gla cost (compile-only TPU devices)", "pip install 'gla-core[tpu]' (or run nox -s cost)")
    start = time.monotonic()
    everything = small_problems() if args.small else production_problems()
    problems = [p for p in everything if not args.op or p.op in args.op]
    chips = tuple(args.chip or ("v6e", "v5e"))
    budget = round(args.memory_budget * GIB)
    full = budget if args.full_shape_budget is None else round(args.full_shape_budget * GIB)
    log = lambda message: print(f"[{time.monotonic() - start:5.0f} s] {message}", file=sys.stderr, flush=True)
    order = [(p.op, p.label) for p in everything]
    store = cost_store.json_path(args.output) if args.output else None
    saving = threading.Lock()

    def keep(clocks: dict, rows: list) -> None:
        """Saves the rows of a problem and chip as soon as they are measured (an interrupted run keeps them)."""
        if store is not None:
            with saving:
                cost_store.save(
                    cost_store.merge(cost_store.load(store), cost_store.Stored(clocks, tuple(rows), ()), order), store
                )

    clocks, rows = {}, []
    if not args.decode_only:
        extra = {p.label: ("fused_g_gamma",) for p in problems if p.op == "simple_gla" and p.spec["gate"] == "g_gamma"}
        # The peers beside the first problem of their op (the production shape of the issues).
        peered = [] if args.no_peers else [next((p.label for p in problems if p.op == op), None) for op in PEER_OPS]
        jobs = args.jobs or DEFAULT_JOBS
        options = dict(
            peered=peered,
            extra=extra,
            ours=not args.peers_only,
            jobs=jobs,
            memory_budget=budget,
            full_shape_budget=full,
        )
        clocks, rows = measure(problems, chips, progress=log, measured=keep, **options)
    decode_ops = [op for op in DECODE_OPS if not args.op or op in args.op]
    decode = []
    if not (args.no_decode or args.peers_only) and "v6e" in chips:
        clock = clocks["v6e"] if "v6e" in clocks else calibrate_clock("v6e", budget)
        decode = measure_decode(decode_ops, clock, "v6e", budget)
        log(f"decode steps: {len(decode)} programs")
    measured = cost_store.Stored(clocks, tuple(rows), tuple(decode))
    if store is not None:
        measured = cost_store.merge(cost_store.load(store), measured, order)
        cost_store.save(measured, store)
    compiler = f"jax {jax.__version__}, libtpu {_installed_version('libtpu')}"
    report = render(measured.clocks, measured.rows, measured.decode, full, compiler)
    log(f"measured in {(time.monotonic() - start) / 60:.1f} min")
    if not args.output:
        print(report)
        return 0
    with open(args.output, "w") as stream:
        stream.write(report + "\n")
    print(f"report written to {args.output} (rows in {cost_store.json_path(args.output)})")
    return 0


def command_tune(args: argparse.Namespace) -> int:
    """Sweeps the tuning options of every TPU implementation of an op by static estimate and
    writes the chip's rows of the per-chip table (`gla_core.tuning`)."""
    from gla_core import tune, tuning
    from gla_core.static_profile import calibrate_clock

    _require("libtpu", "gla tune (compile-only TPU devices)", "pip install 'gla-core[tpu]'")

    def report(trial) -> None:
        cycles = f"{trial.cycles:,} cycles" if trial.cycles is not None else f"failed: {trial.error}"
        check = f" ({trial.stage} check)" if trial.stage else ""
        print(f"  {trial.implementation} {dict(trial.options)}{check}: {cycles}", file=sys.stderr, flush=True)

    shape = dict(batch=args.batch, seq_len=args.seq_len, heads=args.heads, stage=args.stage)
    rows, trials = tune.sweep(args.op, args.chip, progress=report, **shape)
    print(tune.render(args.op, args.chip, rows, trials, calibrate_clock(args.chip)))
    if not rows:
        print(f"no tunable implementation of {args.op} compiled; the table is unchanged", file=sys.stderr)
        return 1
    if not args.dry_run:
        tuning.write_rows(args.chip, args.op, rows)
        print(f"rows of {args.chip}/{args.op} written to {tuning.TABLE_PATH}")
    return 0


def command_schedule(args: argparse.Namespace) -> int:
    """Compiles every Pallas call of one program alone for a compile-only TPU and says what bounds
    its estimated cycles (`gla_core.llo_schedule`)."""
    from gla_core import llo_schedule
    from gla_core.cost import attention_problem, program_spec
    from gla_core.static_profile import schedule_kernels

    _require("libtpu", "gla schedule (compile-only TPU devices)", "pip install 'gla-core[tpu]'")
    problem = attention_problem(args.op, args.batch, args.seq_len, args.heads, gate=args.gate, sequences=args.varlen)
    spec = {**program_spec(problem, args.stage, args.impl), "chip": args.chip}
    kernels = schedule_kernels(spec)
    rows = [
        (
            k.name,
            k.cycles,
            k.steps,
            llo_schedule.ScheduleSummary.from_json(k.schedule) if k.schedule else None,
            k.error or k.schedule_error,
        )
        for k in kernels
    ]
    print(llo_schedule.render(rows))
    print(
        f"\n{args.chip} static estimate of {problem.label} {args.stage}: per kernel compiled alone, the body of a "
        "grid step (bundles) against its longest dependence chain (cycles) and each unit's mean slot use "
        "there (used/slots per bundle). Compiler estimates, not measurements."
    )
    return 0 if all(k.schedule for k in kernels) else 1


def build_parser() -> argparse.ArgumentParser:
    OPS = default_registry().ops()
    parser = argparse.ArgumentParser(prog="gla", description="Gated linear attention kernels: registry and demo.")
    commands = parser.add_subparsers(dest="command", required=True)

    listing = commands.add_parser("list", help="registered implementations and plugin failures")
    listing.set_defaults(run=command_list)

    ex = commands.add_parser("explain", help="which implementation serves a call, and why the others decline")
    ex.add_argument("op", choices=OPS)
    ex.add_argument(
        "-B", "--batch", type=int, default=None, help=f"default {DEFAULT_EXPLAIN_BATCH}; 1 with --varlen (packed input)"
    )
    ex.add_argument("-T", "--seq-len", type=int, default=4096)
    ex.add_argument("-H", "--heads", type=int, default=16)
    ex.add_argument("-K", "--key-dim", type=int, default=128)
    ex.add_argument("-V", "--value-dim", type=int, default=128)
    ex.add_argument("--value-heads", type=int, default=None, help="kda: HV, a multiple of H")
    ex.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ex.add_argument("--gates", default="g", help="simple_gla: comma-separated subset of g,g_gamma (empty: none)")
    ex.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    ex.add_argument("--varlen", type=int, metavar="N", default=None, help="packed input of N sequences (B must be 1)")
    ex.add_argument("--h0", action="store_true", help="pass an initial_state")
    ex.add_argument("--ht", action="store_true", help="request the final state")
    ex.add_argument("--l2norm", action="store_true", help="kda: use_qk_l2norm_in_kernel")
    ex.add_argument("--gate-in-kernel", action="store_true", help="kda: use_gate_in_kernel with A_log")
    ex.add_argument("--dt-bias", action="store_true", help="kda/kda_gate: pass dt_bias")
    ex.add_argument("--lower-bound", type=float, default=None)
    ex.add_argument("--backend", choices=("cpu", "gpu", "tpu"), default=None, help="target backend (default: JAX's)")
    ex.add_argument("--interpret", action="store_true", help="allow Pallas TPU kernels in interpret mode")
    ex.set_defaults(run=command_explain)

    demo = commands.add_parser("demo", help="every op on this backend vs the float64 oracle, with timings")
    demo.add_argument("--all", action="store_true", help="run every accepting implementation, not only the chosen")
    demo.add_argument("--no-timing", action="store_true", help="skip the timing against `reference`")
    demo.add_argument("--op", action="append", choices=OPS, help="only this op (repeatable)")
    demo.set_defaults(run=command_demo)

    bench = commands.add_parser("bench", help="every implementation that runs here, side by side")
    bench.add_argument("--op", action="append", choices=OPS, help="only this op (repeatable)")
    bench.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096], metavar="T")
    bench.add_argument("--skip", action="append", metavar="IMPL", help="skip an implementation (repeatable)")
    bench.add_argument("--plot", metavar="FILE.png", help="also plot time against T (needs matplotlib)")
    bench.set_defaults(run=command_bench)

    cost = commands.add_parser(
        "cost", help="TPU static cost report: time vs HBM floor per program (needs jax[tpu] for compile-only devices)"
    )
    cost.add_argument(
        "--op",
        action="append",
        choices=OPS,
        help="only this op (repeatable); --output keeps the other rows of the last report",
    )
    cost.add_argument("--chip", action="append", choices=("v5e", "v6e"), help="only this chip (repeatable)")
    cost.add_argument("--output", metavar="FILE.md", help="write the markdown report here (its rows go to FILE.json)")
    cost.add_argument(
        "--small",
        action="store_true",
        help="B=1 T=2048 problems with a quarter of the heads instead of the production shapes (a trial run)",
    )
    only = cost.add_mutually_exclusive_group()
    only.add_argument("--no-peers", action="store_true", help="skip the other libraries' kernels")
    cost.add_argument("--no-decode", action="store_true", help="skip the serving decode steps")
    only.add_argument(
        "--decode-only", action="store_true", help="profile only the serving decode steps (v6e); keep every other row"
    )
    only.add_argument(
        "--peers-only",
        action="store_true",
        help="profile only the other libraries' kernels (beside the first problem of their op); keep every other row",
    )
    cost.add_argument("--jobs", type=int, default=None, help="compile subprocesses at once (default 2)")
    cost.add_argument(
        "--memory-budget",
        type=float,
        default=12.0,
        metavar="GB",
        help="memory the compile jobs may reserve at once; a job over its reservation is killed (default 12)",
    )
    cost.add_argument(
        "--full-shape-budget",
        type=float,
        default=None,
        metavar="GB",
        help="compile at the full shape every kernel predicted to fit this, scale the others from their probes "
        "(default and at most: the memory budget; 0: scale every kernel that has probes, the fastest run)",
    )
    cost.set_defaults(run=command_cost)

    schedule = commands.add_parser(
        "schedule", help="what bounds each kernel's TPU static estimate: chain vs slots (needs jax[tpu])"
    )
    schedule.add_argument("op", choices=OPS)
    schedule.add_argument("--chip", choices=("v5e", "v6e"), default="v6e")
    schedule.add_argument("-B", "--batch", type=int, default=1)
    schedule.add_argument("-T", "--seq-len", type=int, default=2048)
    schedule.add_argument("-H", "--heads", type=int, default=4)
    schedule.add_argument("--stage", choices=("fwd", "train"), default="train")
    schedule.add_argument("--impl", default=None, help="implementation (default: the op's default on TPU)")
    schedule.add_argument("--gate", default="g", help="simple_gla: g or g_gamma")
    schedule.add_argument("--varlen", type=int, metavar="N", default=None, help="packed input of N sequences (B=1)")
    schedule.set_defaults(run=command_schedule)

    tuning = commands.add_parser("tune", help="choose per-chip option defaults by TPU static estimate (needs jax[tpu])")
    tuning.add_argument("op", choices=OPS)
    tuning.add_argument("--chip", required=True, choices=("v5e", "v6e", "v7x"))
    tuning.add_argument("-B", "--batch", type=int, default=1)
    tuning.add_argument("-T", "--seq-len", type=int, default=1024)
    tuning.add_argument("-H", "--heads", type=int, default=16)
    tuning.add_argument("--stage", choices=("fwd", "train"), default="train", help="the program whose time counts")
    tuning.add_argument("--dry-run", action="store_true", help="print the sweep, leave the table as it is")
    tuning.set_defaults(run=command_tune)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except GlaError as error:
        print(f"gla {args.command}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
