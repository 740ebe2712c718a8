"""`tandem demo` (`make demo`): the whole system on this machine.

Makes the `small` seeded-random Llama once (`tools.make_model.cached_model`, in the user's
cache), starts a local Ray cluster with one
prefill and one decode actor behind the router, sends a mixed batch of requests through the
real HTTP API (short prompts take the local-prefill path, long ones the disaggregated path;
some streamed), prints each request's TTFT, TPOT and where its prefill ran, then a summary,
and shuts everything down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

WORDS = [
    "tandem",
    "splits",
    "prefill",
    "and",
    "decode",
    "into",
    "two",
    "pools",
    "that",
    "scale",
    "on",
    "their",
    "own",
    "while",
    "the",
    "router",
    "streams",
    "tokens",
    "back",
    "to",
    "every",
    "client",
    "as",
    "soon",
    "as",
    "they",
    "are",
    "ready",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: make `small`)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--disagg-threshold", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)


async def _one(
    session, url: str, i: int, prompt: str, max_tokens: int, stream: bool, delay: float
) -> dict:
    await asyncio.sleep(delay)
    body = {
        "model": "demo",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    t0 = time.perf_counter()
    stamps: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        headers = resp.headers
        if resp.status != 200:
            return {"i": i, "error": f"HTTP {resp.status}: {await resp.text()}"}
        if stream:
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    if json.loads(line[6:])["choices"][0]["text"]:
                        stamps.append(time.perf_counter())
            usage_tokens = max(len(stamps), 1)
        else:
            data = await resp.json()
            stamps.append(time.perf_counter())
            usage_tokens = data["usage"]["completion_tokens"]
    end = time.perf_counter()
    prompt_tokens = None
    ttft = stamps[0] - t0 if stream and stamps else None
    tpot = (end - stamps[0]) / (len(stamps) - 1) if stream and len(stamps) > 1 else None
    return {
        "i": i,
        "stream": stream,
        "path": headers.get("X-Tandem-Path", "?"),
        "prefill": headers.get("X-Tandem-Prefill-Worker", "?"),
        "decode": headers.get("X-Tandem-Decode-Worker", "?"),
        "tokens": usage_tokens,
        "e2e": end - t0,
        "ttft": ttft,
        "tpot": tpot,
        "prompt_tokens": prompt_tokens,
    }


async def _drive(url: str, n: int, seed: int) -> list[dict]:
    import aiohttp

    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        long = i % 2 == 0
        words = rng.randint(120, 300) if long else rng.randint(3, 20)
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        # Every request streams, so TTFT and TPOT are measured per token at the client.
        jobs.append((i, prompt, rng.randint(24, 64), True, i * 0.15))
    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*(_one(session, url, *j) for j in jobs))


def run(args: argparse.Namespace) -> int:
    from cluster.serve import Deployment, ServeSettings
    from tools.make_model import cached_model

    t0 = time.perf_counter()
    model = Path(args.model) if args.model else cached_model(seed=args.seed)
    settings = ServeSettings(
        model=str(model),
        prefill=1,
        decode=1,
        port=0,
        num_cpus=os.cpu_count(),
        disagg_threshold=args.disagg_threshold,
        served_model_name="demo",
        engine={"dtype": args.dtype, "max_num_batched_tokens": 1024, "seed": args.seed},
    )
    with Deployment(settings) as dep:
        print(
            f"\nsending {args.requests} requests (half short: local prefill on the decode "
            f"worker; half long: prefill worker + NIXL hand-off)\n",
            flush=True,
        )
        results = asyncio.run(_drive(dep.url, args.requests, args.seed))
        time.sleep(1.0)  # let the last load reports reach the controller
        loads = dep.worker_loads()
    failed = [r for r in results if "error" in r]
    ok = [r for r in results if "error" not in r]
    _print_requests(results)
    _print_summary(ok, loads)
    print(f"  {len(ok)} ok, {len(failed)} failed, {time.perf_counter() - t0:.1f}s in all")
    return 1 if failed else 0


def _print_requests(results: list[dict]) -> None:
    print(
        f"{'req':>3}  {'path':<6} {'prefill on':<10} {'decode on':<9} {'tokens':>6} "
        f"{'TTFT ms':>8} {'TPOT ms':>8} {'E2E ms':>8}"
    )
    for r in results:
        if "error" in r:
            print(f"{r['i']:>3}  FAILED {r['error']}")
            continue
        print(
            f"{r['i']:>3}  {r['path']:<6} {r['prefill']:<10} {r['decode']:<9} "
            f"{r['tokens']:>6} {r['ttft'] * 1e3:>8.1f} {r['tpot'] * 1e3:>8.1f} "
            f"{r['e2e'] * 1e3:>8.1f}"
        )


def _print_summary(ok: list[dict], loads: dict) -> None:
    """Per-path latency medians, then what the pools did (from their last load reports)."""
    print("\nsummary")
    for path in ("local", "remote"):
        rs = [r for r in ok if r["path"] == path]
        if rs:
            print(
                f"  {path:<6}: {len(rs):>2} requests, TTFT p50 "
                f"{statistics.median(r['ttft'] for r in rs) * 1e3:.1f} ms, TPOT p50 "
                f"{statistics.median(r['tpot'] for r in rs) * 1e3:.1f} ms"
            )
    d, p = loads.get("decode-0", {}), loads.get("prefill-0", {})
    moved = d.get("extra", {}).get("transfer_bytes", 0)
    secs = d.get("extra", {}).get("transfer_seconds", 0) or 1e-9
    print(
        f"  prefill pool: {p.get('extra', {}).get('handoffs', 0)} hand-offs; decode pool: "
        f"{d.get('extra', {}).get('remote_prefills', 0)} remote + "
        f"{d.get('extra', {}).get('local_prefills', 0)} local prefills"
    )
    print(
        f"  KV moved over NIXL: {moved / 2**20:.1f} MiB in {secs * 1e3:.1f} ms "
        f"({moved / secs / 1e9:.2f} GB/s)"
    )
    print(
        f"  KV blocks free after the run: prefill {p.get('num_free_blocks')}/"
        f"{p.get('num_total_blocks')}, decode {d.get('num_free_blocks')}/"
        f"{d.get('num_total_blocks')}"
    )
