"""`tandem simulate`: a trace through the simulated cluster under a scaling policy.

    tandem simulate --trace ../shared/traces/azure_llm_conv_2023.csv --profile h100.json \\
        --policy planner --slo-ttft-ms 1000 --slo-tpot-ms 50 --startup-s 60 --out DIR

`--policy` is a policy spec of cluster.planner.make_policy (`planner`, `static:P:D`,
`colocated:K`, `dynamo`, `threshold`) or a hindsight sweep: `best-static` (the static split
with the fewest GPU-hours reaching `--target-attainment`, P and D within the planner's
--min/--max bounds and --gpu-budget) or `best-colocated` (K from 1 to max-prefill +
max-decode). The planner flags (SLO targets, interval, bounds, start-up, disaggregation
threshold, ...) are generated from `PlannerConfig` and go to the policy and the simulator
alike. Prints a summary table (and the sweep's probes); writes DIR/simulation.json and
DIR/replicas.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.capacity_profile import CapacityProfile
from cluster.planner import make_policy
from cluster.planner.config import PlannerConfig
from cluster.planner.types import COLOCATED_POOL, DECODE_POOL, PREFILL_POOL
from cluster.simulator import report
from cluster.simulator.run import SimConfig, SimResult, simulate
from cluster.simulator.sharegpt import TURNS
from cluster.simulator.sweep import SweepResult, best_colocated, best_static_for
from cluster.simulator.traces import (
    FORMATS,
    DrawnArrivals,
    SimRequest,
    load_requests,
    shape_requests,
)
from engine.config_flags import add_flags, values_from_args

SWEEPS = ("best-static", "best-colocated")
DEFAULT_OUT = "benchmarks/results/simulate"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("trace")
    g.add_argument(
        "--trace",
        required=True,
        help="Azure or BurstGPT CSV, Mooncake JSONL, ServeGen slice or ShareGPT JSON",
    )
    g.add_argument("--trace-format", choices=FORMATS, default="auto", help="(default: auto)")
    g.add_argument("--trace-start-s", type=float, default=0.0, help="skip the trace's first S s")
    g.add_argument("--duration-s", type=float, default=None, help="keep S s of the trace")
    g.add_argument("--time-scale", type=float, default=1.0, help="x arrival times (2: half rate)")
    g.add_argument("--length-scale", type=float, default=1.0, help="x prompt and output lengths")
    g.add_argument("--max-requests", type=int, default=None, help="keep the first N requests")
    g.add_argument(
        "--rate-scale",
        type=int,
        default=1,
        help="superimpose K copies of the trace, each shifted by a random offset (K x the rate, "
        "the trace's shape kept; default: 1)",
    )
    g.add_argument(
        "--rate-jitter-s",
        type=float,
        default=5.0,
        help="copies are shifted by offsets drawn from [0, S) s (default: 5)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the copies' offsets, of a ServeGen slice's draw and of a ShareGPT "
        "trace's sample and arrivals (default: 0)",
    )
    _add_drawn_arrival_arguments(g)
    s = parser.add_argument_group("simulation")
    s.add_argument("--profile", required=True, help="capacity profile JSON (tandem plan/profile)")
    s.add_argument(
        "--policy",
        required=True,
        help="planner | static:P:D | colocated:K | dynamo | threshold | best-static | "
        "best-colocated",
    )
    s.add_argument(
        "--target-attainment", type=float, default=0.99, help="for best-* (default: 0.99)"
    )
    s.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    s.add_argument(
        "--max-overrun-s",
        type=float,
        default=SimConfig.__dataclass_fields__["max_overrun_s"].default,
        help="stop this long after the last arrival even if requests remain (default: %(default)s)",
    )
    s.add_argument("--step-by-step", action="store_true", help="debug: one event per decode step")
    s.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    add_flags(parser, PlannerConfig, title="planner")


def _add_drawn_arrival_arguments(g: argparse._ArgumentGroup) -> None:
    """The flags of a trace without timestamps (ShareGPT): its arrivals and its token counts."""
    g.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="arrivals per second drawn for a trace without timestamps (ShareGPT; required)",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of those inter-arrivals (1: Poisson; below 1 burstier; default: 1)",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="model directory whose tokenizer counts a ShareGPT trace's tokens (default: "
        "an estimate of 4 UTF-8 bytes per token)",
    )
    g.add_argument(
        "--sharegpt-turns",
        choices=TURNS,
        default="first",
        help="a ShareGPT conversation gives its first exchange (as vLLM's benchmark) or a "
        "session of all, each turn resending the ones before (default: first)",
    )
    g.add_argument(
        "--think-time-s",
        type=float,
        default=30.0,
        help="mean seconds between a ShareGPT session's turns (exponential; default: 30)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ValueError as e:
        print(f"tandem simulate: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    requests = shape_requests(
        load_requests(
            args.trace,
            args.trace_format,
            seed=args.seed,
            start_s=args.trace_start_s,
            duration_s=args.duration_s,
            drawn=DrawnArrivals(
                args.request_rate,
                args.burstiness,
                args.tokenizer,
                args.sharegpt_turns,
                args.think_time_s,
            ),
        ),
        start_s=args.trace_start_s,
        duration_s=args.duration_s,
        time_scale=args.time_scale,
        length_scale=args.length_scale,
        max_requests=args.max_requests,
        rate_scale=args.rate_scale,
        rate_jitter_s=args.rate_jitter_s,
        seed=args.seed,
    )
    profile = CapacityProfile.load(args.profile)
    planner_cfg = PlannerConfig(**values_from_args(PlannerConfig, args))
    sim_cfg = SimConfig.for_planner(
        planner_cfg,
        step_by_step=args.step_by_step,
        max_overrun_s=args.max_overrun_s,
        progress=not args.quiet,
    )
    sweep = None
    if args.policy in SWEEPS:
        sweep = _sweep(args.policy, requests, profile, sim_cfg, planner_cfg, args)
        result, best = sweep.best_result, sweep.best
        if result is not None:
            size = f"{best.prefill}:{best.decode}" if sweep.kind == "static" else best.decode
            result.policy = f"{args.policy} ({sweep.kind}:{size})"
    else:
        policy = make_policy(args.policy, profile, planner_cfg)
        result = simulate(requests, profile, policy, sim_cfg)
        result.policy = args.policy  # the spec says more than the policy's name
    _write(Path(args.out), args, profile, result, sweep)
    return 0 if result is not None else 1


def _sweep(
    kind: str,
    requests: list[SimRequest],
    profile: CapacityProfile,
    sim_cfg: SimConfig,
    planner_cfg: PlannerConfig,
    args: argparse.Namespace,
) -> SweepResult:
    if not 0 < args.target_attainment <= 1:
        raise ValueError(f"--target-attainment must be in (0, 1], got {args.target_attainment}")
    c = planner_cfg
    if kind == "best-static":
        return best_static_for(requests, profile, sim_cfg, c, args.target_attainment)
    return best_colocated(
        requests,
        profile,
        sim_cfg,
        lambda k: make_policy(f"colocated:{k}", profile, c),
        replica_counts=(1, c.max_prefill + c.max_decode),
        target=args.target_attainment,
        gpu_budget=c.gpu_budget,
    )


def _write(
    out: Path,
    args: argparse.Namespace,
    profile: CapacityProfile,
    result: SimResult | None,
    sweep: SweepResult | None,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # GPU-hours count each pool's workers at its TP size (colocated: the profile's).
    gpus = {
        COLOCATED_POOL: profile.gpus_per_worker,
        PREFILL_POOL: getattr(args, "prefill_gpus_per_worker", None) or profile.gpus_per_worker,
        DECODE_POOL: getattr(args, "decode_gpus_per_worker", None) or profile.gpus_per_worker,
    }
    inputs = {
        "trace": str(args.trace),
        "profile": str(args.profile),
        "policy_spec": args.policy,
        "profile_model": profile.model,
        "profile_hardware": profile.hardware,
    }
    extra = {"inputs": inputs, "sweep": sweep.to_dict() if sweep else None}
    if sweep is not None:
        print(format_sweep(sweep))
    if result is None:
        report.write_json(
            {"inputs": inputs, "sweep": extra["sweep"], "summary": None}, out / report.RESULT_JSON
        )
        print(f"no {sweep.kind if sweep else ''} configuration reached the target attainment")
        return
    summary = report.summarize(result, gpus)
    print(report.format_table([report.table_row(summary)]))
    paths = [
        report.write_json(report.to_json(result, gpus, extra), out / report.RESULT_JSON),
        report.plot_timeline(result, out / report.TIMELINE_PNG),
    ]
    for path in paths:
        print(f"wrote {path}")


def format_sweep(sweep: SweepResult) -> str:
    """Every probe of a sweep, in the order it ran (a stopped probe's attainment is moot)."""
    static = sweep.kind == "static"
    rows = [
        (
            *((str(p.prefill),) if static else ()),
            str(p.decode),
            "-" if p.aborted else f"{p.attainment:.2%}",
            f"{p.gpu_hours:.2f}",
            "yes" if p.meets else "no",
            p.aborted or "",
        )
        for p in sweep.points
    ]
    sizes = ("P", "D") if static else ("K",)
    return report.format_table(rows, (*sizes, "attain", "GPU-h", "meets", "stopped"))
