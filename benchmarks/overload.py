"""Overload: drive `tandem serve` at twice the rate it holds and check that admission refuses
the excess at once (429 + Retry-After) while everything it accepts completes.

    python benchmarks/overload.py                                  # 30 s at 2x, tiny llama
    python benchmarks/overload.py --duration-s 8 --out /tmp/o.json # smoke

Lifecycle: start `tandem serve` 1P1D with small admission limits (--max-queued-requests,
--max-queued-prompt-tokens) and a small decode batch (--max-num-seqs), so the workers, not
the router, are what saturates -> capacity: a closed-loop ramp (concurrency 1, 2, 4, ...;
each level --level-s seconds, a 429 backs off and retries) until completed requests/s grows
by less than 10%; the best level's rate is the capacity -> open loop: Poisson arrivals at
--overload x capacity for --duration-s, no bound on what is in flight (each arrival is sent
when it is due) -> wait for every accepted request -> KV blocks back -> stop the server.

Every request is a non-streamed completion with ignore_eos (token-id prompt, half of them
above --disagg-threshold, so both prefill paths are loaded), so a 200's usage is known.

Checks: some 429s (else nothing was overloaded and the rest proves nothing); every 429 came
back within --max-429-ms (p99 and max) with a Retry-After header (whole seconds >= 1) and an
OpenAI error body (`error.code` queue_full); every other answer is a 200 with the expected
usage; no 5xx; the router's own `tandem_requests_rejected_total{reason="queue_full"}` counted
the same 429s; KV free == total on every worker at the end; the server exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # allow `python benchmarks/overload.py` from anywhere
    sys.path.insert(0, str(REPO))

from benchmarks.common import CACHE_DIR, log, machine_info, write_json  # noqa: E402
from benchmarks.serve_session import ServeSession, process_label  # noqa: E402
from benchmarks.soak import get_json  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "overload.json"
REJECTED = 'tandem_requests_rejected_total{reason="queue_full"}'
# A client loop lag above this is a stall: answers waited on across it are timed by a client
# that was not running, and are reported apart (latency_429_ms_client_responsive).
STALL_S = 0.02


@dataclass(slots=True)
class Answer:
    """One request's answer: status, seconds from send to the status line (a 429's latency)
    and to the whole body, Retry-After, and what was wrong with it (empty: as expected)."""

    status: int | None
    first_byte_s: float
    total_s: float
    retry_after: str | None = None
    error: str = ""
    sent_at: float = 0.0  # perf_counter() at the send
    client_stalled: bool = False  # this client's loop stalled (> STALL_S) while it waited


@dataclass(slots=True, frozen=True)
class Load:
    """The request shape: prompts of `short` or `long` tokens (alternating), `max_tokens`."""

    model: str
    vocab: int
    short: int
    long: int
    max_tokens: int

    def __post_init__(self) -> None:
        if not (1 <= self.short < self.long and self.max_tokens >= 1 and self.vocab > 8):
            raise ValueError(f"bad load shape {self}")

    def body(self, rng: random.Random, i: int) -> dict[str, Any]:
        n = self.long if i % 2 else self.short
        prompt = [rng.randrange(4, self.vocab) for _ in range(n)]
        return {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens,
                "ignore_eos": True}  # fmt: skip


def judge(status: int, headers: Any, body: Any, sent: dict[str, Any]) -> str:
    """What is wrong with an answer (empty: nothing)."""
    if status == 429:
        retry = headers.get("Retry-After")
        if retry is None or not retry.isdigit() or int(retry) < 1:
            return f"429 with Retry-After {retry!r}"
        err = body.get("error") if isinstance(body, dict) else None
        if not isinstance(err, dict) or err.get("code") != "queue_full" or not err.get("message"):
            return f"429 without an OpenAI queue_full error body: {str(body)[:200]}"
        return ""
    if status != 200:
        return f"HTTP {status}: {str(body)[:200]}"
    usage = body.get("usage") or {}
    want = (len(sent["prompt"]), sent["max_tokens"])
    got = (usage.get("prompt_tokens"), usage.get("completion_tokens"))
    if got != want or body["choices"][0].get("finish_reason") != "length":
        return f"200 with usage {got} (want {want}), finish {body['choices'][0]}"
    return ""


async def send(http: Any, url: str, body: dict[str, Any]) -> Answer:
    import aiohttp

    t0 = time.perf_counter()
    try:
        async with http.post(url + "/v1/completions", json=body) as resp:
            first = time.perf_counter() - t0
            try:
                payload = await resp.json(content_type=None)
            except ValueError:
                payload = None
            error = judge(resp.status, resp.headers, payload, body)
            retry = resp.headers.get("Retry-After")
            return Answer(resp.status, first, time.perf_counter() - t0, retry, error, t0)
    except (aiohttp.ClientError, TimeoutError) as e:
        dt = time.perf_counter() - t0
        return Answer(None, dt, dt, None, f"{type(e).__name__}: {e}", t0)


def _session(limit: int = 0):
    import aiohttp

    # limit=0: no client-side pool limit, so the server sees every arrival when it is due.
    connector = aiohttp.TCPConnector(limit=limit, force_close=False)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600))


# --------------------------------------------------------------------------- capacity


async def closed_loop(url: str, load: Load, concurrency: int, seconds: float) -> dict[str, Any]:
    """`concurrency` clients each sending back to back for `seconds`; a 429 waits and retries."""
    done, errors, rejected = 0, [], 0
    rng = random.Random(concurrency)
    end = time.monotonic() + seconds
    async with _session() as http:

        async def client() -> None:
            nonlocal done, rejected
            while time.monotonic() < end:
                a = await send(http, url, load.body(rng, done + rejected))
                if a.status == 429:
                    rejected += 1
                    await asyncio.sleep(0.05)
                elif a.error:
                    errors.append(a.error)
                else:
                    done += 1

        t0 = time.monotonic()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.monotonic() - t0
    rate = round(done / elapsed, 2)
    return {"concurrency": concurrency, "rps": rate, "completed": done, "rejected": rejected,
            "errors": errors[:5]}  # fmt: skip


def measure_capacity(url: str, load: Load, level_s: float, max_concurrency: int) -> dict:
    """Closed-loop ramp (concurrency 1, 2, 4, ...); stops after two levels in a row that do
    not beat the best by 10% (or on an error); the capacity is the best level's rate."""
    ramp: list[dict[str, Any]] = []
    concurrency, flat = 1, 0
    while concurrency <= max_concurrency:
        level = asyncio.run(closed_loop(url, load, concurrency, level_s))
        ramp.append(level)
        log(f"capacity ramp: concurrency {concurrency}: {level['rps']} req/s "
            f"({level['rejected']} 429 retried, {len(level['errors'])} errors)")  # fmt: skip
        if level["errors"]:
            raise RuntimeError(f"errors while measuring capacity: {level['errors']}")
        best = max(r["rps"] for r in ramp[:-1]) if len(ramp) > 1 else 0.0
        # Two levels in a row without 10% more than the best so far: a noisy level on a
        # shared box does not end the ramp early.
        flat = flat + 1 if level["rps"] < 1.1 * best else 0
        if flat == 2:
            break
        concurrency *= 2
    best = max(ramp, key=lambda r: r["rps"])
    return {"capacity_rps": best["rps"], "at_concurrency": best["concurrency"], "ramp": ramp}


# --------------------------------------------------------------------------- overload


@dataclass(slots=True)
class LagProbe:
    """How late a 5 ms sleep wakes up on this client's loop, sampled back to back: a stalled
    client makes every answer that lands meanwhile look slow, so its lag is reported beside
    the 429 latencies."""

    lags: list[tuple[float, float]] = field(default_factory=list)  # (perf_counter, lag s)
    _task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            self.lags.append((now, now - t - 0.005))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> dict[str, Any]:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        values = [lag for _, lag in self.lags]
        return {"p50": _pct(values, 0.5), "p99": _pct(values, 0.99), "max": _pct(values, 1.0)}


async def open_loop(url: str, load: Load, rate: float, seconds: float) -> dict[str, Any]:
    """Poisson arrivals at `rate` for `seconds`, each sent when due whatever is in flight."""
    # The cyclic GC would stop this client for up to hundreds of ms with thousands of
    # requests in flight, and every answer landing then would read as slow: off meanwhile.
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        return await _arrivals(url, load, rate, seconds)
    finally:
        gc.enable()
        gc.unfreeze()


async def _arrivals(url: str, load: Load, rate: float, seconds: float) -> dict[str, Any]:
    rng = random.Random(7)
    tasks: list[asyncio.Task] = []
    probe = LagProbe()
    probe.start()
    async with _session() as http:
        start, at, i = time.monotonic(), 0.0, 0
        while True:
            at += rng.expovariate(rate)
            if at >= seconds:
                break
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(http, url, load.body(rng, i))))
            i += 1
        offered = len(tasks) / (time.monotonic() - start)
        answers = await asyncio.gather(*tasks)
    lag = await probe.stop()
    t0 = min((a.sent_at for a in answers), default=0.0)
    worst = sorted(probe.lags, key=lambda p: -p[1])[:5]
    # When each of the worst stalls ended (s since the first send) and how long it was (ms).
    lag["worst"] = [[round(t - t0, 3), round(1000 * v, 1)] for t, v in worst]
    stalls = [(end - v, end) for end, v in probe.lags if v > STALL_S]
    for a in answers:
        done = a.sent_at + a.first_byte_s
        a.client_stalled = any(start < done and end > a.sent_at for start, end in stalls)
    return {"answers": list(answers), "offered": offered, "client_loop_lag_ms": lag}


def _quantiles(seconds: list[float]) -> dict[str, Any]:
    """n, and p50/p90/p99/max in ms."""
    qs = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))
    return {"n": len(seconds)} | {q: _pct(seconds, v) for q, v in qs}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def summarize(answers: list[Answer]) -> dict[str, Any]:
    rejected = [a for a in answers if a.status == 429]
    t0 = min((a.sent_at for a in answers), default=0.0)
    accepted = [a for a in answers if a.status != 429]
    statuses: dict[str, int] = {}
    for a in answers:
        statuses[str(a.status)] = statuses.get(str(a.status), 0) + 1
    retry = sorted({int(a.retry_after) for a in rejected if (a.retry_after or "").isdigit()})
    return {
        "sent": len(answers),
        "accepted": len(accepted),
        "completed": sum(1 for a in accepted if a.status == 200 and not a.error),
        "rejected_429": len(rejected),
        "by_status": statuses,
        "http_5xx": sum(1 for a in answers if a.status is not None and a.status >= 500),
        "latency_429_ms": _quantiles([a.first_byte_s for a in rejected]),
        "latency_429_ms_client_responsive": _quantiles(
            [a.first_byte_s for a in rejected if not a.client_stalled]
        ),
        "retry_after_missing": sum(1 for a in rejected if a.retry_after is None),
        "retry_after_values_s": retry,
        "accepted_latency_ms": {"p50": _pct([a.total_s for a in accepted], 0.5),
                                "p99": _pct([a.total_s for a in accepted], 0.99)},
        "slowest_429": [{"at_s": round(a.sent_at - t0, 3), "ms": round(1000 * a.first_byte_s, 1)}
                        for a in sorted(rejected, key=lambda a: -a.first_byte_s)[:10]],
        "errors": [asdict(a) for a in answers if a.error][:20],
    }  # fmt: skip


def evaluate(result: dict[str, Any], max_429_ms: float) -> dict[str, bool]:
    s, kv = result["summary"], result["kv_blocks"]
    lat = s["latency_429_ms"]
    return {
        "saw_429": s["rejected_429"] > 0,
        "fast_429": s["rejected_429"] > 0 and lat["p99"] < max_429_ms and lat["max"] < max_429_ms,
        "retry_after_on_every_429": s["retry_after_missing"] == 0,
        "accepted_all_completed": s["accepted"] > 0 and s["completed"] == s["accepted"],
        "no_errors": not s["errors"],
        "no_5xx": s["http_5xx"] == 0,
        "server_counted_429s": result["server_rejected_429"] == s["rejected_429"],
        "kv_blocks_returned": bool(kv) and all(b["free"] == b["total"] for b in kv.values()),
        "clean_shutdown": result["shutdown"]["exit_code"] in (0, None)
        and not result["shutdown"]["leftovers"],
    }


def renice_workers(session: ServeSession, nice: int) -> None:
    """Lower the worker actors' CPU priority. On a CPU-only box the workers' compute and the
    router share the cores; on a GPU deployment the compute runs on the GPUs and the router
    has its cores. Niced workers still use every idle cycle, but no longer delay the router
    (and this client) by a scheduler slice when both want the CPU."""
    workers = [
        p for p in session.processes() if "WorkerActor" in process_label(
            " ".join(p.cmdline()), p.pid, session.session_id)
    ]  # fmt: skip
    if not workers:
        raise RuntimeError("--nice-workers: no WorkerActor process in the server's session")
    for p in workers:
        p.nice(nice)
    log(f"reniced {len(workers)} worker actors to {nice}")


def overload(session: ServeSession, args: argparse.Namespace) -> dict[str, Any]:
    model = get_json(session.url + "/v1/models")["data"][0]
    vocab = json.loads(Path(model["root"], "config.json").read_text())["vocab_size"]
    load = Load(model["id"], vocab, args.short_prompt, args.long_prompt, args.max_tokens)
    if args.nice_workers:
        renice_workers(session, args.nice_workers)
    capacity = measure_capacity(session.url, load, args.level_s, args.max_concurrency)
    rate = args.overload * capacity["capacity_rps"]
    log(f"capacity {capacity['capacity_rps']} req/s; open loop at {rate:.1f} req/s "
        f"for {args.duration_s} s")  # fmt: skip
    rejected0 = session.metrics().get(REJECTED, 0.0)
    t0 = time.monotonic()
    run = asyncio.run(open_loop(session.url, load, rate, args.duration_s))
    elapsed = time.monotonic() - t0
    kv = session.wait_kv_free(args.kv_timeout_s)
    return {
        "capacity": capacity,
        "target_rps": round(rate, 2),
        "offered_rps": round(run["offered"], 2),
        "elapsed_s": round(elapsed, 2),
        "summary": summarize(run["answers"]),
        "client_loop_lag_ms": run["client_loop_lag_ms"],
        "server_rejected_429": int(session.metrics().get(REJECTED, 0.0) - rejected0),
        "kv_blocks": kv,
    }


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint dir (default: the cached tiny llama)")
    p.add_argument("--duration-s", type=float, default=30.0, help="open-loop phase length")
    p.add_argument("--overload", type=float, default=2.0, help="x the measured capacity")
    p.add_argument("--level-s", type=float, default=4.0, help="seconds per ramp level")
    p.add_argument("--max-concurrency", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--short-prompt", type=int, default=32, help="tokens; below the threshold")
    p.add_argument("--long-prompt", type=int, default=128, help="tokens; above the threshold")
    p.add_argument("--disagg-threshold", type=int, default=64)
    p.add_argument("--max-queued-requests", type=int, default=16)
    p.add_argument("--max-queued-prompt-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=16, help="decode batch of the server")
    p.add_argument("--max-429-ms", type=float, default=100.0)
    p.add_argument(
        "--nice-workers",
        type=int,
        default=0,
        help="renice the worker actors (0: leave them): a CPU box's stand-in for GPU workers",
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--serve-arg", action="append", default=[], help="extra tandem serve flag")
    p.add_argument("--kv-timeout-s", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.duration_s <= 0 or args.overload <= 1 or args.level_s <= 0:
        p.error("need --duration-s > 0, --overload > 1 and --level-s > 0")
    if not 0 <= args.nice_workers <= 19:
        p.error("--nice-workers must lie in 0..19")
    if args.disagg_threshold < 8 or args.max_tokens < 1:
        p.error("need --disagg-threshold >= 8 and --max-tokens >= 1")
    if not 1 <= args.short_prompt < args.disagg_threshold <= args.long_prompt:
        p.error("need 1 <= --short-prompt < --disagg-threshold <= --long-prompt")
    return args


def start_server(args: argparse.Namespace) -> ServeSession:
    if args.model is None:
        from tools.make_model import cached_model

        args.model = str(cached_model("llama", "tiny", 0, cache_dir=CACHE_DIR))
    flags = ["--num-cpus", str(args.num_cpus), "--dtype", args.dtype]
    flags += ["--disagg-threshold", str(args.disagg_threshold)]
    flags += ["--max-queued-requests", str(args.max_queued_requests)]
    flags += ["--max-queued-prompt-tokens", str(args.max_queued_prompt_tokens)]
    flags += ["--max-num-seqs", str(args.max_num_seqs), *args.serve_arg]
    log(f"starting tandem serve {args.model} {' '.join(flags)}")
    return ServeSession.start(Path(args.model), args.out.parent / "raw" / "overload-serve", flags)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_at_start = list(os.getloadavg())
    session = start_server(args)
    try:
        result = overload(session, args)
    finally:
        shutdown = session.stop()
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine_info(threads=args.num_cpus),
        "load_avg_at_start": load_at_start,
        "shutdown": shutdown,
        **result,
    }
    result["checks"] = evaluate(result, args.max_429_ms)
    result["passed"] = all(result["checks"].values())
    s = result["summary"]
    log(f"offered {result['offered_rps']} req/s (target {result['target_rps']}): sent "
        f"{s['sent']}, accepted {s['accepted']}, completed {s['completed']}, 429 "
        f"{s['rejected_429']} (server counted {result['server_rejected_429']}), "
        f"5xx {s['http_5xx']}")  # fmt: skip
    log(f"429 latency ms {s['latency_429_ms']}; while this client never stalled "
        f"{s['latency_429_ms_client_responsive']}")  # fmt: skip
    log(
        f"(this client's loop lag ms "
        f"{result['client_loop_lag_ms']}); Retry-After values {s['retry_after_values_s']}; "
        f"accepted latency ms {s['accepted_latency_ms']}; KV {result['kv_blocks']}"
    )
    for e in s["errors"][:5]:
        log(f"ERROR: {e}")
    log("checks: " + " ".join(f"{k}={'ok' if v else 'FAIL'}" for k, v in result["checks"].items()))
    write_json(args.out, result)
    log(f"wrote {args.out}: {'PASSED' if result['passed'] else 'FAILED'}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
