"""Disaggregated (bf16 and quantized) vs colocated serving on the same cores.

    python benchmarks/compare_disagg.py            # the full run (~25 min on 2 cores)
    python benchmarks/compare_disagg.py --quick    # smoke run (1 scenario, 1 rate, 4 prompts)

Four deployments of the same model on the same CPU share (one core per worker), started one
after the other, each kept up while every scenario and rate runs against it:

- disagg:             1 prefill + 1 decode actor (every prompt prefilled on the prefill actor:
                      --disagg-threshold 0, so the decode actor only decodes);
- disagg-quantized:   the same with `tandem serve --quantized` (FP8 W8A8 prefill, weight-only
                      decode: int8 on CPU, FP8 KV);
- colocated-chunked:  2 colocated replicas, chunked prefill with a `--chunk-budget` token
                      budget per step (a prompt longer than it is split over steps, each
                      step still carrying the running decodes);
- colocated-nochunk:  2 colocated replicas, no chunking (a whole prompt in one step).

Lifecycle: for each mode -> start a `Deployment` (local Ray, num_cpus=2) -> warm-up requests ->
for each scenario, for each rate: `run_benchmark` (Poisson arrivals, token-id prompts, exact
output lengths via ignore_eos, temperature 0) -> one raw JSON per point -> stop the deployment.
Then: compare.json (every point's headline metrics), compare.md (the table and the TPOT p99
ratios disagg/colocated) and one PNG per scenario (TPOT p99, TTFT p50 and goodput against rate,
one line per mode), all under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # allow `python benchmarks/compare_disagg.py` from anywhere
    sys.path.insert(0, str(REPO))

from benchmarks.compare_report import MODES, Point, write_report  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "compare"


@dataclass(slots=True, frozen=True)
class Scenario:
    name: str
    input_len: int  # mean; lengths are uniform on [L(1-r), L(1+r)]
    input_range: float
    output_len: int
    output_range: float
    rates: tuple[float, ...]  # requests/s
    num_prompts: int
    slo_ttft_ms: float
    slo_tpot_ms: float

    def __post_init__(self) -> None:
        if not self.rates or any(not r > 0 for r in self.rates):
            raise ValueError(f"{self.name}: rates must be > 0, got {self.rates}")
        if self.num_prompts < 1:
            raise ValueError(f"{self.name}: num_prompts must be >= 1")

    @property
    def lengths_text(self) -> str:
        def span(mean: int, r: float) -> str:
            return f"{math.floor(mean * (1 - r))}-{math.floor(mean * (1 + r))}"

        return (
            f"prompt {span(self.input_len, self.input_range)}, "
            f"output {span(self.output_len, self.output_range)}"
        )


# Rates: the lowest is light load for every mode, the highest keeps the colocated replicas
# busy (probed on the 2-core dev box with the `small` model; float32 then, bfloat16 since the
# CPU kernels made bf16 the faster dtype here).
SCENARIOS: dict[str, Scenario] = {
    "chat": Scenario("chat", 320, 0.6, 80, 0.6, (0.5, 1.0, 2.0), 16, 2000.0, 50.0),
    # 24 requests per point: the TPOT p99 of 16 is nearly the maximum of a handful.
    "summarize": Scenario("summarize", 1152, 1 / 3, 72, 1 / 3, (0.2, 0.5, 0.8), 24, 4000.0, 50.0),
    "decode-heavy": Scenario(
        "decode-heavy", 96, 1 / 3, 384, 1 / 3, (0.2, 0.4, 0.8), 16, 2000.0, 50.0
    ),
}
QUICK = Scenario("chat", 48, 0.3, 12, 0.3, (2.0,), 4, 5000.0, 500.0)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- running


def mode_settings(mode: str, model: str, args: argparse.Namespace):
    from cluster.serve import ServeSettings

    engine = {
        "dtype": args.dtype,
        "seed": 0,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_chunked_prefill": True,
        "kv_cache_memory_gb": args.kv_cache_gb,
    }
    if mode in ("disagg", "disagg-quantized"):
        return ServeSettings(
            model=model,
            mode="disagg",
            prefill=1,
            decode=1,
            port=0,
            num_cpus=args.num_cpus,
            disagg_threshold=args.disagg_threshold,
            served_model_name="bench",
            engine=engine,
            quantized=mode == "disagg-quantized",
        )
    if mode == "colocated-chunked":
        engine["max_num_batched_tokens"] = args.chunk_budget
    else:
        engine["enable_chunked_prefill"] = False
    return ServeSettings(
        model=model,
        mode="colocated",
        replicas=2,
        port=0,
        num_cpus=args.num_cpus,
        served_model_name="bench",
        engine=engine,
    )


def bench_config(url: str, sc: Scenario, rate: float, vocab: int, seed: int):
    from bench.config import BenchConfig

    return BenchConfig(
        base_url=url,
        model="bench",
        num_prompts=sc.num_prompts,
        input_len=sc.input_len,
        input_range=sc.input_range,
        output_len=sc.output_len,
        output_range=sc.output_range,
        request_rate=rate,
        seed=seed,
        slo_ttft_ms=sc.slo_ttft_ms,
        slo_tpot_ms=sc.slo_tpot_ms,
        vocab_low=16,  # above the special tokens
        vocab_high=min(8000, vocab),
        temperature=0.0,
        ignore_eos=True,
        request_timeout_s=900.0,
        progress=False,
    )


def warm_up(url: str, vocab: int, long_len: int) -> None:
    """Long and short prompts, two at once so every replica compiles/allocates before timing."""
    from bench.client import run_benchmark
    from bench.config import BenchConfig

    for n in (long_len, 32):
        cfg = BenchConfig(
            base_url=url,
            model="bench",
            num_prompts=4,
            input_len=n,
            output_len=8,
            vocab_low=16,
            vocab_high=min(8000, vocab),
            request_rate=math.inf,
            max_concurrency=2,
            progress=False,
            seed=99,
        )
        res = asyncio.run(run_benchmark(cfg))
        if res.metrics.completed == 0:
            raise RuntimeError(f"warm-up failed: {res.errors}")


def _fmt_rate(rate: float) -> str:
    return f"{rate:g}".replace(".", "p")


def run_mode(
    mode: str, model: str, scenarios: list[Scenario], args, out: Path, vocab: int
) -> list[Point]:
    from bench.client import run_benchmark
    from cluster.serve import Deployment

    settings = mode_settings(mode, model, args)
    points: list[Point] = []
    log(f"== {mode}: starting deployment")
    with Deployment(settings) as dep:
        weights = _weights(dep)
        log(f"== {mode}: weights {weights}")
        longest = max(math.floor(s.input_len * (1 + s.input_range)) for s in scenarios)
        warm_up(dep.url, vocab, longest)
        log(f"== {mode}: warmed up")
        for sc in scenarios:
            si = list(SCENARIOS).index(sc.name) if sc.name in SCENARIOS else 0
            for ri, rate in enumerate(sc.rates):
                # Fresh prompts per point (the same in every mode): a point that reused an
                # earlier point's prompts would be served from the prefix cache.
                seed = args.seed + 1000 * si + ri
                cfg = bench_config(dep.url, sc, rate, vocab, seed)
                load = os.getloadavg()[0]
                before = dep.worker_loads()
                res = asyncio.run(run_benchmark(cfg))
                after = dep.worker_loads()
                raw = out / "raw" / f"{sc.name}_{mode}_r{_fmt_rate(rate)}.json"
                res.write_json(raw)
                m = res.metrics
                p = Point(
                    scenario=sc.name,
                    mode=mode,
                    rate=rate,
                    completed=m.completed,
                    failed=m.failed,
                    duration_s=m.duration_s,
                    ttft_p50_ms=m.ttft_ms.p50,
                    ttft_p99_ms=m.ttft_ms.p99,
                    tpot_p50_ms=m.tpot_ms.p50,
                    tpot_p99_ms=m.tpot_ms.p99,
                    itl_p99_ms=m.itl_ms.p99,
                    output_tok_s=m.output_tok_s,
                    goodput_rps=m.goodput_rps,
                    request_throughput=m.request_throughput,
                    load_avg_1m=max(load, os.getloadavg()[0]),
                    raw_json=str(raw.relative_to(out)),
                    worker_stats=_step_counts(before, after, weights),
                )
                points.append(p)
                log(
                    f"{sc.name:<12} {mode:<18} rate {rate:<5g} ok {m.completed}/"
                    f"{m.completed + m.failed}  TTFT p50 {_ms(p.ttft_p50_ms)}  TPOT p99 "
                    f"{_ms(p.tpot_p99_ms)}  goodput {p.goodput_rps:.2f}/s  "
                    f"load {p.load_avg_1m:.1f}  ({m.duration_s:.0f}s)"
                )
                if m.failed:
                    log(f"   errors: {res.errors}")
    log(f"== {mode}: stopped")
    return points


def _weights(dep) -> dict[str, str]:
    """Per worker: the weight layout it loaded (the dtype, or its resolved quantization)."""
    import ray

    return {wid: ray.get(a.info.remote())["weights"] for wid, a in dep.actors.items()}


def _step_counts(before: dict, after: dict, weights: dict[str, str]) -> dict:
    """Per worker: its weights, and the engine steps and prefill paths taken during one point
    (from load reports)."""
    out = {}
    for wid, a in after.items():
        b = before.get(wid, {})
        ex_a, ex_b = a.get("extra", {}) or {}, b.get("extra", {}) or {}
        row = {"weights": weights.get(wid, "?")}
        for k in ("local_prefills", "remote_prefills", "handoffs"):
            if k in ex_a:
                row[k] = ex_a[k] - ex_b.get(k, 0)
        out[wid] = row
    return out


def _ms(x: float | None) -> str:
    return "   n/a" if x is None else f"{x:7.1f}ms"


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """What to measure and where the results go."""
    p.add_argument("--model", default=None, help="model directory (default: the demo `small`)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 short scenario, 1 rate, 4 prompts per mode",
    )
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated subset of {', '.join(SCENARIOS)}",
    )
    p.add_argument("--modes", default=",".join(MODES), help=f"subset of {', '.join(MODES)}")
    p.add_argument(
        "--rates",
        type=_floats,
        default=None,
        help="override every scenario's rates (req/s, comma-separated)",
    )
    p.add_argument("--num-prompts", type=int, default=None, help="override requests per point")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep points of an earlier compare.json in --out that this run does not remeasure",
    )


def _add_deployment_flags(p: argparse.ArgumentParser) -> None:
    """How each deployment is configured."""
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray cluster")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget per step of the disagg workers",
    )
    p.add_argument(
        "--chunk-budget",
        type=int,
        default=512,
        help="token budget per step of colocated-chunked (prompt chunk + decodes)",
    )
    p.add_argument(
        "--disagg-threshold",
        type=int,
        default=0,
        help="disagg: prompts shorter than this are prefilled on the decode actor",
    )
    p.add_argument("--kv-cache-gb", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Split the comma-separated selections and reject unknown names (p.error exits)."""
    if args.num_prompts is not None and args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    args.modes = [m for m in args.modes.split(",") if m]
    for s in args.scenarios:
        if s not in SCENARIOS:
            p.error(f"unknown scenario {s!r}; choose from {', '.join(SCENARIOS)}")
    for m in args.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _add_run_flags(p)
    _add_deployment_flags(p)
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def chosen_scenarios(args) -> list[Scenario]:
    from dataclasses import replace

    base = [QUICK] if args.quick else [SCENARIOS[s] for s in args.scenarios]
    out = []
    for sc in base:
        if args.rates:
            sc = replace(sc, rates=args.rates)
        if args.num_prompts:
            sc = replace(sc, num_prompts=args.num_prompts)
        out.append(sc)
    return out


def _reported(scenarios: list[Scenario], points: list[Point]) -> list[Scenario]:
    """The scenarios behind every point (merged points keep their default definitions)."""
    named = {s.name: s for s in scenarios}
    for p in points:
        if p.scenario not in named and p.scenario in SCENARIOS:
            named[p.scenario] = SCENARIOS[p.scenario]
    return list(named.values())


def _check_lengths(scenarios: list[Scenario], model: str, max_position: int) -> None:
    """Exit before starting anything if a scenario's longest request does not fit the model."""
    for sc in scenarios:
        need = math.floor(sc.input_len * (1 + sc.input_range)) + math.floor(
            sc.output_len * (1 + sc.output_range)
        )
        if need > max_position:
            raise SystemExit(f"{sc.name} needs {need} tokens; {model} holds {max_position}")


def _merge_earlier(points: list[Point], out: Path) -> list[Point]:
    """The points of an earlier compare.json in `out` that this run did not remeasure, then
    this run's points."""
    if not (out / "compare.json").is_file():
        return points
    new = {p.key for p in points}
    old = json.loads((out / "compare.json").read_text())["points"]
    kept = [Point(**d) for d in old if (d["scenario"], d["mode"], d["rate"]) not in new]
    return kept + points


def build_meta(
    args, model: str, command: str, t0: float, scenarios: list[Scenario], points: list[Point]
) -> dict:
    """The run's description: machine, model, settings, scenarios and load range."""
    from benchmarks.common import machine_info

    loads = [p.load_avg_1m for p in points]
    machine = machine_info(1)
    return {
        "model": model,
        "model_name": Path(model).name,
        "dtype": args.dtype,
        "cpu": machine["cpu"],
        "logical_cpus": machine["logical_cpus"],
        "machine": machine,
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "wall_s": time.perf_counter() - t0,
        "command": command.strip(),
        "load_min": min(loads),
        "load_max": max(loads),
        "settings": {
            "num_cpus": args.num_cpus,
            "disagg": "1 prefill + 1 decode actor, max_num_batched_tokens "
            f"{args.max_num_batched_tokens}, disagg_threshold {args.disagg_threshold}",
            "disagg-quantized": "the same with --quantized (FP8 W8A8 prefill, weight-only "
            "decode, FP8 KV)",
            "colocated-chunked": f"2 replicas, chunked prefill, budget {args.chunk_budget}",
            "colocated-nochunk": "2 replicas, no chunked prefill (whole prompt per step)",
        },
        "scenarios": [
            {**asdict(s), "lengths": s.lengths_text} for s in _reported(scenarios, points)
        ],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.config import ModelConfig
    from tools.make_model import cached_model

    model = str(Path(args.model) if args.model else cached_model())
    mc = ModelConfig.from_pretrained(model)
    scenarios = chosen_scenarios(args)
    _check_lengths(scenarios, model, mc.max_position)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/compare_disagg.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    t0 = time.perf_counter()
    log(
        f"model {model}; modes {args.modes}; scenarios "
        + "; ".join(f"{s.name} rates {s.rates} x {s.num_prompts}" for s in scenarios)
    )
    points: list[Point] = []
    for mode in args.modes:
        points += run_mode(mode, model, scenarios, args, out, mc.vocab_size)
    if args.merge:
        points = _merge_earlier(points, out)
    meta = build_meta(args, model, command, t0, scenarios, points)
    write_report(points, meta, out, SCENARIOS)
    log(f"done in {time.perf_counter() - t0:.0f}s")
    return 0 if all(p.completed > 0 for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
