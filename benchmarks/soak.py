"""Soak: thousands of mixed requests against one `tandem serve`, then look for what leaked.

    python benchmarks/soak.py                                  # 5000 requests, 1P1D, tiny llama
    python benchmarks/soak.py --requests 150 --out /tmp/s.json # smoke
    python benchmarks/soak.py --url http://127.0.0.1:8000      # attach to a running server
    python benchmarks/soak.py --mix multiturn --serve-arg=--kv-host-cache-gb --serve-arg=0.001
        # multi-turn chats only (issue 24): also checks the host KV tier and the index bounded

Lifecycle: start `tandem serve` 1P1D in its own session (or attach: the session of the process
listening on --url's port) -> sample RSS and open fds of every process of that session
("start") -> build the seeded request mix -> send it open-loop (Poisson arrivals at --rate,
at most --concurrency in flight) -> sample again once the first --warmup-frac of requests
are done ("warm") -> when all are done, wait until every worker's KV blocks are free, let it
settle, sample ("end") -> stop the server (SIGTERM; it must exit 0 and leave no process) ->
checks, a per-process table, the JSON (--out) and a plot of RSS and fds over time beside it.

The mix and the checks of each answer: benchmarks/soak_workload.py. The server and its
processes: benchmarks/serve_session.py.

Checks: RSS and fd growth from "warm" to "end" under --max-growth-pct, summed and per process;
no process appeared after warm-up; KV free == total on every worker at the end; no 5xx; every
good request answered 200 with the expected usage; every bad one a 4xx; both prefill paths ran;
the host KV tier within its slots and the router's KV index within --kv-index-max-entries.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # allow `python benchmarks/soak.py` from anywhere
    sys.path.insert(0, str(REPO))

from benchmarks.common import CACHE_DIR, log, machine_info, write_json  # noqa: E402
from benchmarks.serve_session import MB, Sampler, ServeSession, growth, idle_growth  # noqa: E402
from benchmarks.soak_workload import (  # noqa: E402
    MIX,
    Outcome,
    RequestSpec,
    WorkloadContext,
    build_multiturn_workload,
    build_workload,
    run_one,
)

DEFAULT_OUT = REPO / "benchmarks" / "results" / "soak.json"


@dataclass(slots=True)
class Progress:
    """Counts outcomes as they land, takes the "warm" snapshot, prints a line every `every`.

    "warm" is taken once `warm_at` requests are done and both prefill paths have answered
    one (a prompt over the disaggregation threshold and one under it, `Outcome.long`): the
    first remote prefill sets up its worker pair's NIXL connection once (+4-10 fds a worker),
    which is warm-up, not a leak; a smoke run's first 15 requests need not include one. If
    the run never answers both, "warm" is taken at the last request (and the paths check
    fails on its own)."""

    total: int
    every: int
    warm_at: int
    sampler: Sampler
    t0: float = field(default_factory=time.monotonic)
    done: int = 0
    inflight: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    answered: set[bool] = field(default_factory=set)  # `long` of the ok outcomes so far
    warm: bool = False

    def __post_init__(self) -> None:
        if self.every < 1 or not 1 <= self.warm_at <= self.total:
            raise ValueError(f"every {self.every} / warm_at {self.warm_at} out of range")

    def record(self, out: Outcome) -> None:
        self.done += 1
        self.counts[out.result] = self.counts.get(out.result, 0) + 1
        if out.status is not None and out.status >= 500:
            self.counts["5xx"] = self.counts.get("5xx", 0) + 1
        if out.result == "ok":
            self.answered.add(out.long)
        both = len(self.answered) == 2
        if not self.warm and self.done >= self.warm_at and (both or self.done == self.total):
            self.warm = True
            snap = self.sampler.snapshot("warm")
            log(f"warm-up done ({self.done} requests): RSS {_total_mb(snap):.0f} MB")
        if self.done % self.every == 0 or self.done == self.total:
            elapsed = time.monotonic() - self.t0
            counts = " ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
            log(
                f"{self.done}/{self.total} in {elapsed:.0f}s ({self.done / elapsed:.1f} req/s) "
                f"inflight={self.inflight} {counts}"
            )


def _total_mb(snap: dict[int, dict[str, Any]]) -> float:
    return sum(s["rss"] for s in snap.values()) / MB


async def drive(
    url: str, specs: list[RequestSpec], rate: float, concurrency: int, progress: Progress
) -> list[Outcome]:
    """Open loop: Poisson arrivals at `rate` (each keeps its schedule), at most `concurrency`
    in flight (an arrival waits for a slot)."""
    import aiohttp

    rng = random.Random(len(specs))
    sem = asyncio.Semaphore(concurrency)
    outcomes: list[Outcome] = []
    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=concurrency + 8)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:

        async def one(spec: RequestSpec) -> None:
            progress.inflight += 1
            try:
                out = await run_one(http, url, spec)
            finally:
                progress.inflight -= 1
                sem.release()
            outcomes.append(out)
            progress.record(out)

        tasks, start, at = [], time.monotonic(), 0.0
        for spec in specs:
            at += rng.expovariate(rate)
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await sem.acquire()
            tasks.append(asyncio.create_task(one(spec)))
        await asyncio.gather(*tasks)
    return sorted(outcomes, key=lambda o: o.index)


# --------------------------------------------------------------------------- the run


def get_json(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=30) as r:
        return json.loads(r.read())


def workload_context(session: ServeSession, model_dir: str | None, threshold: int):
    """The served model's name, vocabulary and context, and its chat template (local
    tokenizer), checked against the server's own /tokenize count."""
    from transformers import AutoTokenizer

    model = get_json(session.url + "/v1/models")["data"][0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir or model["root"])

    def chat_len(messages: list[dict[str, str]]) -> int:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        # transformers 5 answers a BatchEncoding, 4 a plain list
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

    probe = [{"role": "user", "content": "alpha beta gamma"}]
    served = get_json(session.url + "/tokenize", {"model": model["id"], "messages": probe})
    if served["count"] != chat_len(probe):
        raise RuntimeError(
            f"the local chat template counts {chat_len(probe)} tokens, the server "
            f"{served['count']}: is --model the checkpoint the server runs?"
        )
    return WorkloadContext(model["id"], len(tokenizer), threshold, model["max_model_len"], chat_len)


def disagg_paths(session: ServeSession) -> dict[str, float]:
    m = session.metrics()
    return {
        p: m.get(f'tandem_disagg_decisions_total{{path="{p}"}}', 0.0) for p in ("local", "remote")
    }


def summarize(specs: list[RequestSpec], outcomes: list[Outcome]) -> dict[str, Any]:
    by_kind: dict[str, dict[str, int]] = {}
    statuses: dict[str, int] = {}
    for o in outcomes:
        kind = by_kind.setdefault(o.kind, {})
        kind[o.result] = kind.get(o.result, 0) + 1
        statuses[str(o.status)] = statuses.get(str(o.status), 0) + 1
    ok = [o for o in outcomes if o.result == "ok"]
    return {
        "total": len(outcomes),
        "by_result": {r: sum(1 for o in outcomes if o.result == r) for r in _RESULTS},
        "by_kind": by_kind,
        "by_status": statuses,
        "good": sum(1 for s in specs if s.good),
        "bad": sum(1 for s in specs if not s.good),
        "ok_long_prompts": sum(1 for o in ok if o.long),
        "ok_short_prompts": sum(1 for o in ok if not o.long),
        "http_5xx": sum(1 for o in outcomes if o.status is not None and o.status >= 500),
        "latency_p50_s": _quantile([o.latency_s for o in ok], 0.5),
        "latency_p99_s": _quantile([o.latency_s for o in ok], 0.99),
        "failures": [asdict(o) for o in outcomes if o.result == "failed"][:20],
    }


_RESULTS = ("ok", "aborted", "refused", "failed")


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


def evaluate(result: dict[str, Any], max_pct: float) -> dict[str, bool]:
    g, req, kv, paths = result["growth"], result["requests"], result["kv_blocks"], result["paths"]
    checks = {
        "rss_growth_sum": g["totals"]["rss"]["growth_pct"] < max_pct,
        "fd_growth_sum": g["totals"]["fds"]["growth_pct"] < max_pct,
        "rss_growth_per_process": not [o for o in g["over"] if o["metric"] == "rss"],
        "fd_growth_per_process": not [o for o in g["over"] if o["metric"] == "fds"],
        "no_new_processes": not g["appeared"],
        "kv_blocks_returned": bool(kv) and all(b["free"] == b["total"] for b in kv.values()),
        "no_5xx": req["http_5xx"] == 0,
        "good_requests_ok": req["by_result"]["failed"] == 0 and req["by_result"]["ok"] > 0,
        "bad_requests_4xx": req["by_result"]["refused"] == req["bad"],
        "both_prefill_paths": paths["local"] > 0 and paths["remote"] > 0,
    }
    b = result.get("kv_bounds")
    if b is not None:
        checks["host_pool_bounded"] = all(
            h["used"] <= h["total"] for h in b["host_blocks"].values()
        )
        checks["index_bounded"] = b["index_entries"] <= b["index_max_entries"]
    if result["shutdown"]["exit_code"] is not None:  # only for a server this run started
        checks["clean_shutdown"] = (
            result["shutdown"]["exit_code"] == 0 and not result["shutdown"]["leftovers"]
        )
    return checks


def kv_bounds(metrics: dict[str, float], serve_args: list[str]) -> dict[str, Any]:
    """The host KV tier's slots in use per worker and the router's index entries, against
    their caps (--kv-host-cache-gb's slots; --kv-index-max-entries)."""
    from dataclasses import fields

    from router.config import RouterConfig

    cap = next(f.default for f in fields(RouterConfig) if f.name == "kv_index_max_entries")
    if "--kv-index-max-entries" in serve_args:
        cap = int(serve_args[serve_args.index("--kv-index-max-entries") + 1])
    host = {}
    for key, value in metrics.items():
        m = re.match(r'tandem_kv_host_(used|total)_blocks\{.*worker="([^"]+)"', key)
        if m:
            host.setdefault(m.group(2), {})[m.group(1)] = int(value)
    return {
        "host_blocks": host,
        "index_entries": int(metrics.get("tandem_kv_index_entries", 0)),
        "index_max_entries": cap,
    }


def soak(session: ServeSession, args: argparse.Namespace) -> dict[str, Any]:
    ctx = workload_context(session, args.model, args.disagg_threshold)
    if args.mix == "multiturn":
        specs = build_multiturn_workload(args.requests, args.seed, ctx, args.turns)
    else:
        specs = build_workload(args.requests, args.seed, ctx)
    paths0 = disagg_paths(session)
    with Sampler(session, args.sample_interval_s) as sampler:
        if args.idle_s > 0:  # a baseline: what grows with time alone, no requests
            sampler.snapshot("idle0")
            log(f"idle baseline: {args.idle_s:.0f} s with no requests")
            time.sleep(args.idle_s)
            sampler.snapshot("idle1")
        sampler.snapshot("start")
        warm_at = max(1, int(args.requests * args.warmup_frac))
        progress = Progress(args.requests, args.progress_every, warm_at, sampler)
        t0 = time.monotonic()
        outcomes = asyncio.run(drive(session.url, specs, args.rate, args.concurrency, progress))
        elapsed = time.monotonic() - t0
        sampler.marks["load_end"] = time.monotonic() - sampler.t0
        kv = session.wait_kv_free(args.kv_timeout_s)
        time.sleep(args.settle_s)  # let the last frees and GC settle before the end sample
        sampler.snapshot("end")
    paths1 = disagg_paths(session)
    bounds = kv_bounds(session.metrics(), args.serve_arg)
    idle = idle_growth(sampler.snapshots, sampler.marks) if args.idle_s > 0 else {}
    return {
        "idle_rss_growth_pct": {str(pid): pct for pid, pct in idle.items()},
        "duration_s": round(elapsed, 2),
        "achieved_rate_rps": round(len(outcomes) / elapsed, 2),
        "requests": summarize(specs, outcomes),
        "growth": growth(sampler.snapshots, args.max_growth_pct),
        "kv_blocks": kv,
        "paths": {p: paths1[p] - paths0[p] for p in paths1},
        "kv_bounds": bounds,
        "timeline": sampler.timeline,
        "marks": sampler.marks,
    }


# --------------------------------------------------------------------------- reporting


def print_table(g: dict[str, Any], max_pct: float, idle: dict[str, float]) -> None:
    """Per process: RSS and fds at start/warm/end, growth warm -> end, and (with --idle-s)
    the RSS growth the same process showed idle over as long a time."""
    log(f"{'process':<32} {'pid':>7} {'RSS MB start/warm/end':>24} {'growth':>8} "
        f"{'idle':>7} {'fds start/warm/end':>19} {'growth':>8}")  # fmt: skip
    for r in g["processes"] + [{"name": "SUM", "pid": "", **_sum_row(g["totals"])}]:
        rss, fds = r["rss"], r["fds"]
        mb = "/".join("-" if v is None else f"{v / MB:.1f}" for v in rss.values())
        fd = "/".join("-" if v is None else str(v) for v in fds.values())
        base = idle.get(str(r["pid"]))
        base_text = "-" if base is None else f"{base:.2f}%"
        log(f"{r['name'][:32]:<32} {r['pid']:>7} {mb:>24} {r['rss_growth_pct']:>7.2f}% "
            f"{base_text:>7} {fd:>19} {r['fds_growth_pct']:>7.2f}%")  # fmt: skip
    for o in g["over"]:
        log(
            f"OVER {max_pct}%: {o['name']} (pid {o['pid']}) {o['metric']} {o['warm']} -> {o['end']}"
        )
    for p in g["appeared"]:
        log(f"APPEARED after warm-up: {p['name']} (pid {p['pid']}) RSS {p['rss'] / MB:.1f} MB")
    for p in g["gone"]:
        log(f"gone after warm-up: {p['name']} (pid {p['pid']})")


def _sum_row(totals: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for metric in ("rss", "fds"):
        t = totals[metric]
        out[metric] = {k: t[k] for k in ("start", "warm", "end")}
        out[f"{metric}_growth_pct"] = t["growth_pct"]
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """RSS and open fds of every process over time, warm-up and load end marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {str(r["pid"]): r["name"] for r in result["growth"]["processes"]}
    names |= {
        str(p["pid"]): p["name"] for p in result["growth"]["appeared"] + result["growth"]["gone"]
    }
    fig, (ax_rss, ax_pct, ax_fds) = plt.subplots(3, 1, figsize=(12, 11), sharex=True)
    pids = sorted({pid for s in result["timeline"] for pid in s["procs"]}, key=int)
    colors = plt.get_cmap("tab20").colors
    for i, pid in enumerate(pids):
        pts = [(s["t"], *s["procs"][pid]) for s in result["timeline"] if pid in s["procs"]]
        label = f"{names.get(pid, '?')} ({pid})"
        color = colors[i % len(colors)]
        ax_rss.plot([p[0] for p in pts], [p[1] / MB for p in pts], label=label, color=color)
        # Growth is a few percent of hundreds of MB: invisible on the MB scale.
        pct = [100.0 * (p[1] - pts[0][1]) / pts[0][1] for p in pts]
        ax_pct.plot([p[0] for p in pts], pct, color=color)
        ax_fds.plot([p[0] for p in pts], [p[2] for p in pts], label=label, color=color)
    for ax in (ax_rss, ax_pct, ax_fds):
        for mark, t in result["marks"].items():
            ax.axvline(t, color="grey", linestyle="--", linewidth=0.8)
            ax.text(t, ax.get_ylim()[1], f" {mark}", fontsize=7, va="top")
        ax.grid(alpha=0.3)
    ax_rss.set_ylabel("RSS (MB)")
    ax_pct.set_ylabel("RSS change since first sample (%)")
    ax_fds.set_ylabel("open fds")
    ax_fds.set_xlabel("seconds")
    ax_rss.set_title(f"soak: {result['requests']['total']} requests")
    ax_rss.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="attach to this running tandem serve instead of starting one")
    p.add_argument("--model", help="checkpoint dir (default: the cached tiny llama)")
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--rate", type=float, default=50.0, help="mean arrivals per second")
    p.add_argument("--concurrency", type=int, default=32, help="most requests in flight")
    p.add_argument("--warmup-frac", type=float, default=0.1)
    p.add_argument("--max-growth-pct", type=float, default=5.0)
    p.add_argument("--disagg-threshold", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray cluster")
    p.add_argument("--serve-arg", action="append", default=[], help="extra tandem serve flag")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mix", choices=("default", "multiturn"), default="default",
                   help="multiturn: greedy multi-turn chats only (soak_workload.py)")  # fmt: skip
    p.add_argument("--turns", type=int, default=4, help="--mix multiturn: turns per chat")
    p.add_argument("--progress-every", type=int, default=0, help="default: requests / 20")
    p.add_argument("--sample-interval-s", type=float, default=1.0)
    p.add_argument("--settle-s", type=float, default=3.0)
    p.add_argument(
        "--idle-s", type=float, default=0.0, help="first sample this long with no requests"
    )
    p.add_argument("--kv-timeout-s", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON; the plot goes beside it")
    args = p.parse_args(argv)
    if args.requests < 10 or not 0 < args.warmup_frac < 1 or args.rate <= 0:
        p.error("need --requests >= 10, 0 < --warmup-frac < 1 and --rate > 0")
    if args.concurrency < 1 or args.disagg_threshold < 8:
        p.error("need --concurrency >= 1 and --disagg-threshold >= 8")
    args.progress_every = args.progress_every or max(1, args.requests // 20)
    return args


def open_session(args: argparse.Namespace) -> ServeSession:
    if args.url:
        return ServeSession.attach(args.url)
    if args.model is None:
        from tools.make_model import cached_model

        args.model = str(cached_model("llama", "tiny", 0, cache_dir=CACHE_DIR))
    flags = ["--num-cpus", str(args.num_cpus), "--dtype", args.dtype]
    flags += ["--disagg-threshold", str(args.disagg_threshold), *args.serve_arg]
    log(f"starting tandem serve {args.model} {' '.join(flags)}")
    session = ServeSession.start(Path(args.model), args.out.parent / "raw" / "soak-serve", flags)
    log(f"serving on {session.url} (session {session.session_id})")
    return session


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_at_start = list(os.getloadavg())
    session = open_session(args)
    try:
        result = soak(session, args)
    finally:
        shutdown = session.stop()
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "mix": MIX,
        "machine": machine_info(threads=args.num_cpus),
        "load_avg_at_start": load_at_start,
        "shutdown": shutdown,
        **result,
    }
    result["checks"] = evaluate(result, args.max_growth_pct)
    result["passed"] = all(result["checks"].values())
    result["plot"] = str(args.out.with_suffix(".png"))
    print_table(result["growth"], args.max_growth_pct, result["idle_rss_growth_pct"])
    log(f"requests: {result['requests']['by_result']} 5xx={result['requests']['http_5xx']} "
        f"({result['achieved_rate_rps']} req/s over {result['duration_s']} s)")  # fmt: skip
    log(f"KV blocks at the end: {result['kv_blocks']}; prefill paths: {result['paths']}")
    log(f"host tier and index at the end: {result['kv_bounds']}")
    for f in result["requests"]["failures"][:5]:
        log(f"FAILED #{f['index']} {f['kind']}: {f['error']}")
    log("checks: " + " ".join(f"{k}={'ok' if v else 'FAIL'}" for k, v in result["checks"].items()))
    write_json(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    verdict = "PASSED" if result["passed"] else "FAILED"
    log(f"wrote {args.out} and {args.out.with_suffix('.png')}: {verdict}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
