"""KV reuse across turns through a live `tandem serve` 2P2D: each part of issue 24 on and off,
the same conversations, one run.

    .venv/bin/python benchmarks/multiturn.py --mooncake \\
        benchmarks/traces/mooncake_conversation_20min.jsonl.gz --tokens-per-hash 32 \\
        --max-blocks 12 --conversations 8 --turns 4 --json benchmarks/results/multiturn.json
    .venv/bin/python benchmarks/multiturn.py --sharegpt FILE.json ...    # multi-turn ShareGPT
    .venv/bin/python benchmarks/multiturn.py ...                        # seeded synthetic chats

Configurations (`--configs`, each a fresh `tandem serve`, started as bench/live_server.py does):
`today` = decode-side reuse off (`--no-decode-kv-reuse`: the decode worker READs every
block), no host tier, `--routing affinity`; `all-on` = reuse on, `--kv-host-cache-gb`, and
`--routing kv-events` with prefix pull (a prefill worker READs the prompt's leading blocks
from the worker holding more of them); `reuse`, `host`, `events`, `pull` = one part alone on
top of `today` (`pull` needs kv-events routing: events + pull); `no-pull` = all-on without
prefix pull.
The workload (benchmarks/multiturn_workload.py) is built once; conversations run concurrently
(at most --concurrency at a time), each one's turns one after another (closed loop: the trace's
timestamps are not kept). Requests are greedy, streamed, `ignore_eos`, token-id prompts.

Per configuration: TTFT p50/p90 (all turns, and turns after the first), prefill tokens
computed (sum of usage prompt_tokens - cached_tokens; and from the workers' counters), KV
bytes the decode pool READ, per pool the prefix-cache hits per tier over the tokens looked up,
the decode pool's reused/read blocks, the router's index size. The workload's reuse ratio is
1 - (tokens no cache held / prompt tokens). Ratios against `today` are printed, with the
issue's acceptance checks (bytes <= 40% of today's, prefill tokens within 5% of the tokens no
cache held, TTFT p50 below today's). Answers must be the same text in every configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # allow `python benchmarks/multiturn.py` from anywhere
    sys.path.insert(0, str(REPO))

from bench.live_server import LiveServer  # noqa: E402
from benchmarks import multiturn_workload as mw  # noqa: E402
from benchmarks.conversations import add_conversation_flags, resolve_model  # noqa: E402

# name -> (routing, decode-side reuse, host tier, prefix pull)
CONFIGS = {
    "today": ("affinity", False, False, False),
    "all-on": ("kv-events", True, True, True),
    "reuse": ("affinity", True, False, False),
    "host": ("affinity", False, True, False),
    "events": ("kv-events", False, False, False),
    "pull": ("kv-events", False, False, True),
    "no-pull": ("kv-events", True, True, False),
}
_SAMPLE = re.compile(r"^tandem_([a-z_]+?)(?:_total)?\{(.*)\}$")
_COUNTERS = (
    "kv_transfer_bytes", "prefix_cache_hit_tokens", "kv_host_hit_tokens",
    "prefix_cache_query_tokens", "kv_read_blocks", "kv_reused_blocks", "kv_host_promotions",
    "kv_host_demotions", "kv_remote_prefills", "kv_handoffs", "kv_recomputes", "preemptions",
    "kv_prefix_pulls", "kv_prefix_pulled_blocks", "kv_prefix_pull_bytes",
)  # fmt: skip


def server_flags(args, name: str) -> list[str]:
    routing, reuse, host, pull = CONFIGS[name]
    flags = ["--prefill", str(args.prefill), "--decode", str(args.decode), "--dtype", "float32"]
    flags += ["--routing", routing, "--decode-kv-reuse" if reuse else "--no-decode-kv-reuse"]
    flags += ["--prefix-pull" if pull else "--no-prefix-pull"]
    flags += ["--kv-host-cache-gb", str(args.host_gb if host else 0.0)]
    flags += ["--num-kv-blocks", str(args.num_blocks), "--block-size", str(args.block_size)]
    flags += ["--disagg-threshold", str(args.disagg_threshold), "--log-level", "WARNING"]
    return flags + ["--num-cpus", str(args.num_cpus)]


async def _turn(session, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            for choice in chunk.get("choices") or ():
                if choice.get("text") and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(choice.get("text") or "")
            usage = chunk.get("usage") or usage
        where = [resp.headers.get(f"X-Tandem-{h}", "") for h in ("Path", "Prefill-Worker")]
    if usage is None:
        raise RuntimeError("the stream ended without usage")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0, "text": "".join(text),
            "prompt_tokens": usage["prompt_tokens"], "cached_tokens": cached,
            "where": "/".join(where)}  # fmt: skip


async def replay(url: str, convs, concurrency: int) -> dict[tuple[int, int], dict]:
    """Every conversation's turns in order; returns (conversation, turn) -> result."""
    import aiohttp

    out: dict[tuple[int, int], dict] = {}
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=600)

    async def one(i: int, conv) -> None:
        async with gate:
            for k, (prompt, max_tokens) in enumerate(conv):
                out[(i, k)] = await _turn(session, url, prompt, max_tokens)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(i, c) for i, c in enumerate(convs)))
    return out


def pool_counters(metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    """role -> counter (the _COUNTERS, summed over the role's workers)."""
    pools: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        m = _SAMPLE.match(key)
        if not m or m.group(1) not in _COUNTERS:
            continue
        role = re.search(r'role="([^"]+)"', m.group(2))
        if role:
            pool = pools.setdefault(role.group(1), dict.fromkeys(_COUNTERS, 0.0))
            pool[m.group(1)] += value
    return pools


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def _hit_ratios(pools: dict[str, dict[str, float]]) -> dict[str, dict]:
    """Per pool: prefix-cache hit tokens per tier over the tokens looked up; for the decode
    pool also the share of remote prompts' blocks taken from its own cache (not READ)."""
    hits = {}
    for role, c in pools.items():
        query, hit = c["prefix_cache_query_tokens"], c["prefix_cache_hit_tokens"]
        host = c["kv_host_hit_tokens"]
        hits[role] = {
            "device_hit_ratio": _ratio(hit - host, query),
            "host_hit_ratio": _ratio(host, query),
            "query_tokens": int(query),
        }
    dec = pools.get("decode", dict.fromkeys(_COUNTERS, 0.0))
    reused, read = dec["kv_reused_blocks"], dec["kv_read_blocks"]
    hits.setdefault("decode", {})["remote_reused_block_ratio"] = _ratio(reused, reused + read)
    return hits


def _ms(xs: list[float], q: float) -> float | None:
    """The q-quantile of xs in ms (nearest rank), None for no samples."""
    if not xs:
        return None
    xs = sorted(xs)
    return round(1e3 * xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))], 1)


def summarize(results: dict, metrics: dict[str, float], seconds: float) -> dict:
    ttft = [r["ttft"] for r in results.values()]
    later = [r["ttft"] for (_, k), r in results.items() if k > 0]
    pools = pool_counters(metrics)
    computed = sum(r["prompt_tokens"] - r["cached_tokens"] for r in results.values())
    by_workers = sum(
        c["prefix_cache_query_tokens"] - c["prefix_cache_hit_tokens"] for c in pools.values()
    )
    return {
        "seconds": round(seconds, 1),
        "ttft_ms_p50": _ms(ttft, 0.5),
        "ttft_ms_p90": _ms(ttft, 0.9),
        "ttft_ms_p50_later_turns": _ms(later, 0.5),
        "ttft_ms_p90_later_turns": _ms(later, 0.9),
        "prompt_tokens": sum(r["prompt_tokens"] for r in results.values()),
        "prefill_tokens_computed": computed,
        "prefill_tokens_computed_workers": int(by_workers),
        # Every READ: the decode pool's hand-offs and the prefill pool's prefix pulls.
        "kv_bytes_read": int(
            pools.get("decode", {}).get("kv_transfer_bytes", 0)
            + pools.get("prefill", {}).get("kv_prefix_pull_bytes", 0)
        ),
        "hit_ratios": _hit_ratios(pools),
        "pools": {role: {k: int(v) for k, v in c.items()} for role, c in pools.items()},
        "router_index_entries": metrics.get("tandem_kv_index_entries"),
        # [conversation, turn, "path/prefill worker", prompt tokens, tokens computed]
        "requests": [
            [i, k, r.get("where", ""), r["prompt_tokens"], r["prompt_tokens"] - r["cached_tokens"]]
            for (i, k), r in sorted(results.items())
        ],
    }


def settled_metrics(server: LiveServer, timeout_s: float = 20.0) -> dict[str, float]:
    """/metrics once the workers' counters stop moving: they arrive with each worker's next
    load report, a beat after the last answer."""
    last, deadline = None, time.monotonic() + timeout_s
    while True:
        time.sleep(0.75)
        now = server.metrics()
        if pool_counters(now) == last or time.monotonic() > deadline:
            return now
        last = pool_counters(now)


def run_config(args, name: str, convs, workdir: Path) -> tuple[dict, dict]:
    server = LiveServer(args.model, workdir / name, *server_flags(args, name)).start()
    try:
        t0 = time.perf_counter()
        results = asyncio.run(replay(server.url, convs, args.concurrency))
        seconds = time.perf_counter() - t0
        summary = summarize(results, settled_metrics(server), seconds)
        summary["leaked_blocks"] = server.wait_blocks_free()
    finally:
        summary_exit = server.stop()
    summary["exit_code"] = summary_exit
    return summary, {key: r["text"] for key, r in results.items()}


def build_workload(args) -> list[list[mw.Turn]]:
    vocab = resolve_model(args)
    if args.mooncake:
        return mw.mooncake_conversations(
            args.mooncake, tokens_per_hash=args.tokens_per_hash, max_blocks=args.max_blocks,
            conversations=args.conversations, turns=args.turns,
            answer_tokens=args.answer_tokens, vocab=vocab, seed=args.seed,
        )  # fmt: skip
    if args.sharegpt:
        from engine.model_info import load_tokenizer

        tok = load_tokenizer(args.model)
        if tok is None:
            raise SystemExit(f"{args.model} has no tokenizer: ShareGPT text needs one")
        return mw.sharegpt_conversations(
            args.sharegpt, tok, conversations=args.conversations, turns=args.turns,
            answer_tokens=args.answer_tokens, max_message_tokens=args.user_tokens,
        )  # fmt: skip
    return mw.synthetic_conversations(args, random.Random(args.seed), vocab)


def compare(runs: dict[str, dict], workload: dict) -> dict:
    """Ratios against `today` and the issue's acceptance checks for `all-on`."""
    base = runs.get("today")
    out: dict = {}
    for name, r in runs.items():
        if base is None or name == "today":
            continue
        out[name] = {
            "bytes_vs_today": _ratio(r["kv_bytes_read"], base["kv_bytes_read"]),
            "ttft_p50_vs_today": _ratio(r["ttft_ms_p50"], base["ttft_ms_p50"]),
            "prefill_vs_today": _ratio(
                r["prefill_tokens_computed"], base["prefill_tokens_computed"]
            ),
        }
    for name, r in runs.items():
        out.setdefault(name, {})["prefill_vs_no_cache_held"] = _ratio(
            r["prefill_tokens_computed"], workload["tokens_no_cache_held"]
        )
    on = runs.get("all-on")
    if base is not None and on is not None:
        out["acceptance"] = {
            "bytes_at_most_40pct_of_today": on["kv_bytes_read"] <= 0.4 * base["kv_bytes_read"],
            "prefill_within_5pct_of_no_cache_held": out["all-on"]["prefill_vs_no_cache_held"]
            <= 1.05,
            "ttft_p50_below_today": on["ttft_ms_p50"] < base["ttft_ms_p50"],
        }
    return out


def report(runs: dict[str, dict], ratios: dict, workload: dict) -> None:
    print(f"workload: {workload}")
    for name, r in runs.items():
        hits = ", ".join(
            f"{role} dev {h.get('device_hit_ratio')} host {h.get('host_hit_ratio')}"
            for role, h in r["hit_ratios"].items()
        )
        print(
            f"{name:>7}: TTFT p50 {r['ttft_ms_p50']} ms p90 {r['ttft_ms_p90']} ms; prefill "
            f"{r['prefill_tokens_computed']} tokens (by the workers' counters "
            f"{r['prefill_tokens_computed_workers']}); "
            f"KV read {r['kv_bytes_read'] / 2**20:.1f} MiB; hits: {hits}; decode reused "
            f"{r['hit_ratios']['decode'].get('remote_reused_block_ratio')}; {r['seconds']} s"
        )
    for name, x in ratios.items():
        print(f"{name:>7}: {x}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_conversation_flags(ap, conversations=8, turns=4, first_tokens=160, user_tokens=32,
                           answer_tokens=16)  # fmt: skip
    ap.add_argument("--mooncake", type=Path, help="Mooncake JSONL(.gz) with hash_ids")
    ap.add_argument("--sharegpt", type=Path, help="ShareGPT JSON with multi-turn conversations")
    ap.add_argument("--tokens-per-hash", type=int, default=32, help="tokens per Mooncake hash id")
    ap.add_argument("--max-blocks", type=int, default=12, help="Mooncake: longest prompt in ids")
    ap.add_argument("--configs", nargs="+", default=["today", "all-on"], choices=list(CONFIGS))
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--num-blocks", type=int, default=64, help="device KV blocks per worker")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--host-gb", type=float, default=0.5)
    ap.add_argument("--disagg-threshold", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument(
        "--workdir", type=Path, help="keep each server's log here (default: a temp dir)"
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    convs = build_workload(args)
    if not convs:
        raise SystemExit("the workload is empty")
    workload = mw.workload_summary(convs, args.block_size)
    # Start a Ray of our own even when another job on the box has one running.
    os.environ.setdefault("RAY_ADDRESS", "local")
    runs, answers = {}, {}
    with tempfile.TemporaryDirectory(prefix="tandem-multiturn-") as tmp:
        workdir = args.workdir or Path(tmp)
        for name in args.configs:
            print(f"[{name}] {' '.join(server_flags(args, name))}", flush=True)
            runs[name], answers[name] = run_config(args, name, convs, workdir)
    first = next(iter(answers.values()))
    differ = {n: sum(a[k] != first[k] for k in first) for n, a in answers.items()}
    ratios = compare(runs, workload)
    report(runs, ratios, workload)
    result = {"model": str(args.model), "machine": _cpu(), "argv": sys.argv[1:] if argv is None
              else argv, "workload": workload, "runs": runs, "ratios": ratios,
              "answers_differing_from_first_config": differ}  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        plot(runs, args.json.with_suffix(".png"))
    bad = [n for n, r in runs.items() if r["leaked_blocks"] or r["exit_code"]]
    if any(differ.values()) or bad:
        print(f"FAILED: answers differing {differ}; leaked/unclean exit: {bad}")
        return 1
    return 0


def plot(runs: dict[str, dict], path: Path) -> None:
    """Bars per configuration: KV MiB READ, TTFT p50 and prefill tokens computed, each
    against the first configuration's (the run's baseline, `today` by default)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(runs)
    metrics = (("kv_bytes_read", "KV bytes READ"), ("ttft_ms_p50", "TTFT p50"),
               ("prefill_tokens_computed", "prefill tokens computed"))  # fmt: skip
    fig = Figure(figsize=(1.4 + 1.1 * len(names), 3.6))
    ax = fig.add_subplot()
    width = 0.8 / len(metrics)
    for i, (key, label) in enumerate(metrics):
        base = runs[names[0]][key] or 1
        xs = [j + (i - 1) * width for j in range(len(names))]
        ax.bar(xs, [runs[n][key] / base for n in names], width, label=label)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(f"x {names[0]} (same run)")
    ax.set_title("Multi-turn 2P2D: each part of KV reuse on and off")
    ax.set_ylim(0, max(1.35, ax.get_ylim()[1] + 0.2))
    ax.legend(fontsize=8, loc="upper right", ncols=3)
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(str(path))


def _cpu() -> str:
    import subprocess

    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line]
    return (names[0] if names else platform.processor()) + f", {out.count('processor') or ''}"


if __name__ == "__main__":
    sys.exit(main())
