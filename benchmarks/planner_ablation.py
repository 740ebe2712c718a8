"""The planner alone with settings changed, against the static sweeps already recorded.

    PYTHONPATH=. .venv/bin/python benchmarks/planner_ablation.py --set burst_half_life_s=0
    PYTHONPATH=. .venv/bin/python benchmarks/planner_ablation.py --rows syn-flat,syn-steps \\
        --set down_fraction=0.5 --json /tmp/ablation.json

`autoscale_results.py` runs every policy and sweeps the static splits (about 43 minutes for
the four result sets on a 2-core Xeon). To ask what one planner setting buys, the sweeps need
not run again: this runs the planner per row twice in the same run, as `autoscale_results.py`
configures it (the baseline) and with each `--set` applied, and compares each against the
cheapest static split recorded in that row's committed results JSON at the run's own
attainment (rounded down to 0.01%, as there). The recorded points are the splits that
run's searches tried (for 99% and for its planner's attainment): a run far below them finds
the split they hold, where a full sweep might find a cheaper one, so a ratio at much lower
attainment flatters the run (autoscale_results.py is the judge). A row prints attainment,
GPU-hours, that split and the ratio for both runs, the change in GPU-hours between them,
and how far the trace's busiest seconds stand over the minute before them (`peak_ratios`).
Rows whose trace is not on this machine (the Azure CSVs live outside the repository) are
skipped with a note.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TypeVar

from bench.capacity_profile import CapacityProfile
from cluster.planner import make_policy
from cluster.planner.config import PlannerConfig
from cluster.simulator import report
from cluster.simulator.run import simulate

try:  # `python benchmarks/planner_ablation.py` has benchmarks/ itself on sys.path
    from benchmarks import autoscale_results as ar
except ImportError:  # pragma: no cover
    import autoscale_results as ar

# row -> (trace, copies superimposed, seed, results JSON under benchmarks/results): the rows of
# the four committed result sets (benchmarks/README.md, "Autoscaling").
ROWS = {
    "mc-conv": ("mc-conv", 1, 0, "autoscale_results.json"),
    "mc-synth": ("mc-synth", 1, 0, "autoscale_results.json"),
    "conv": ("conv", 20, 0, "autoscale_results.json"),
    "code": ("code", 10, 0, "autoscale_results.json"),
    "conv-heldout": ("conv", 10, 1, "heldout/autoscale_results.json"),
    "code-heldout": ("code", 5, 1, "heldout/autoscale_results.json"),
    **{f"sg-h{h}": (f"sg-h{h}", 1, 0, "servegen/autoscale_results.json") for h in (10, 20)},
    **{
        f"syn-{k}": (f"syn-{k}", 1, 0, "synthetic/autoscale_results.json")
        for k in ("flat", "diurnal", "steps", "clumped", "longctx")
    },
}
RESULTS = Path("benchmarks/results")
T, R = TypeVar("T"), TypeVar("R")


def parse_settings(items: list[str]) -> dict[str, object]:
    """`NAME=VALUE` pairs as PlannerConfig overrides (VALUE read as JSON, else a string)."""
    fields = {f.name for f in dataclasses.fields(PlannerConfig)}
    settings: dict[str, object] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or name not in fields:
            raise SystemExit(f"--set {item!r}: want NAME=VALUE with NAME a PlannerConfig field")
        try:
            settings[name] = json.loads(raw)
        except json.JSONDecodeError:
            settings[name] = raw
    try:  # the config's own checks, here rather than in a worker process
        dataclasses.replace(PlannerConfig(), **settings)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"--set: {e}") from None
    return settings


def cheapest_static(points: list[dict], attainment: float) -> dict | None:
    """The cheapest recorded static split reaching `attainment` (rounded down to 0.01%)."""
    floor = ar.attainment_floor(attainment)
    fits = [p for p in points if not p.get("aborted") and p["attainment"] >= floor]
    return min(fits, key=lambda p: p["gpu_hours"], default=None)


def peak_ratios(requests: list, window_s: int = 10, context_s: int = 60) -> dict[str, float]:
    """How far each window's busiest second stands over the traffic before it: per window,
    the most prompt tokens arriving within one second over the mean prompt tokens per second
    of the `context_s` before the window (windows after the first `context_s` with any
    traffic before them), as quantiles. Poisson arrivals of long-tailed prompts stand at
    1.5-2.5x; clumped clients far higher. What the burst hold (a decaying 1-s peak) meets."""
    per_second: dict[int, int] = {}
    for r in requests:
        per_second[int(r.arrival_s)] = per_second.get(int(r.arrival_s), 0) + r.prompt_len
    end = max(per_second, default=0) + 1
    ratios = []
    for start in range(context_s, end, window_s):
        before = sum(per_second.get(s, 0) for s in range(start - context_s, start)) / context_s
        if before > 0:
            busiest = max(per_second.get(s, 0) for s in range(start, start + window_s))
            ratios.append(busiest / before)
    ratios.sort()
    if not ratios:
        return {}
    pick = {"p50": 0.5, "p90": 0.9, "p99": 0.99, "max": 1.0}
    return {k: ratios[min(len(ratios) - 1, int(q * len(ratios)))] for k, q in pick.items()}


def run_row(job: tuple[str, dict[str, object], str]) -> dict:
    """One row: the planner as configured, then with `settings`, each against the sweeps."""
    row, settings, profile_path = job
    trace, scale, seed, results_json = ROWS[row]
    source = ar.TRACES[trace][0]
    if not source.startswith(ar.SYNTHETIC) and not Path(source).exists():
        return {"row": row, "skipped": f"{source} is not on this machine"}
    recorded = json.loads((RESULTS / results_json).read_text())["traces"][trace]
    points = [p for sweep in recorded["sweeps"].values() for p in sweep["points"]]
    args = ar.parse_args(
        ["--traces", trace, "--rate-scale", f"{trace}={scale}", "--seed", str(seed)]
    )
    requests = ar.trace_requests(trace, args)
    config, sim = ar.configs(args, trace, requests)
    profile = CapacityProfile.load(profile_path)
    out = {"row": row, "peak_ratios": peak_ratios(requests)}
    for label, cfg in (("baseline", config), ("changed", dataclasses.replace(config, **settings))):
        if not settings and label == "changed":
            out[label] = out["baseline"]  # the same run: nothing was changed
            continue
        result = simulate(requests, profile, make_policy("planner", profile, cfg), sim)
        static = cheapest_static(points, result.attainment)
        out[label] = {
            "attainment": result.attainment,
            "gpu_hours": result.gpu_hours,
            "static": None if static is None else f"{static['prefill']}:{static['decode']}",
            "ratio": None if static is None else result.gpu_hours / static["gpu_hours"],
            "direction_changes": report.direction_changes(result),
        }
    return out


def add_run_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """The flags every planner benchmark run takes: settings, profile, jobs, JSON out."""
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--profile", default="benchmarks/results/profile-llama3-8b-h100.json")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", default=None, help=f"also write the {what} here")


def map_jobs(fn: Callable[[T], R], jobs: list[T], workers: int) -> Iterator[R]:
    """`fn` over `jobs`, results in order: in this process for one worker, else in spawned
    ones (a forked child would share this process's ZMQ and NIXL state when a test suite
    calls a benchmark's main)."""
    if workers <= 1:
        yield from map(fn, jobs)
        return
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=spawn) as pool:
        yield from pool.map(fn, jobs)


def describe(run: dict) -> str:
    ratio = "-" if run["ratio"] is None else f"{run['ratio']:.3f}"
    return f"{run['attainment']:.4%} {run['gpu_hours']:7.3f} GPU-h vs {run['static']} -> {ratio}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated: {list(ROWS)}")
    add_run_arguments(p, "rows")
    args = p.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        p.error(f"--rows: unknown {unknown}; rows are {', '.join(ROWS)}")
    settings = parse_settings(args.set)
    print(f"changed: {settings or 'nothing (both runs are the baseline)'}", flush=True)
    jobs = [(row, settings, args.profile) for row in rows]
    results = []
    for out in map_jobs(run_row, jobs, args.jobs):
        results.append(out)
        if "skipped" in out:
            print(f"{out['row']:13s} skipped: {out['skipped']}", flush=True)
            continue
        base, changed = out["baseline"], out["changed"]
        delta = changed["gpu_hours"] / base["gpu_hours"]
        print(
            f"{out['row']:13s} baseline {describe(base)} | changed {describe(changed)}"
            f" | GPU-h x{delta:.3f}",
            flush=True,
        )
        peaks = ", ".join(f"{k} {v:.2f}" for k, v in out["peak_ratios"].items())
        print(f"{'':13s} busiest second / the minute before: {peaks}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": settings, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
