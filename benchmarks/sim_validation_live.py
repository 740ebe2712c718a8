"""The live side of benchmarks/sim_validation.py: the trace a replay sends, the `tandem bench
serve` client that sends it, the warm-up, and what else ran on the machine meanwhile.

Lifecycle: `write_trace_csv` (the workload as an Azure-format trace) -> `wait_quiet` (until
other jobs leave the cores alone) -> `replay` under a `CpuAccount` and a `ForeignTimeline`
(server, client and other jobs' CPU) -> records. `calibrate_corun` measures, on the same
server, how much the two workers slow each other down when both compute (the 2-core box
shares cores and memory bandwidth), which the profile does not measure.
"""

from __future__ import annotations

import asyncio
import csv
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.metrics import RequestRecord

# Prompt ids are drawn above the special tokens (the ids a tokenizer reserves).
VOCAB_LOW = 16


@dataclass(frozen=True, slots=True)
class TraceRow:
    arrival_s: float
    prompt_len: int
    output_len: int


def write_trace_csv(path: Path, rows: list[TraceRow]) -> Path:
    """The Azure trace format (plain-seconds timestamps), which both `tandem bench serve
    --dataset trace:` and `tandem simulate --trace` read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for r in rows:
            w.writerow([repr(r.arrival_s), r.prompt_len, r.output_len])
    return path


async def replay(
    url: str, trace: Path, vocab: int, seed: int, concurrency: int | None = None
) -> list[RequestRecord]:
    """Send the trace with the `tandem bench serve` client; one record per row, in order."""
    from bench.client import run_benchmark
    from bench.config import COMPLETIONS, BenchConfig

    config = BenchConfig(
        base_url=url,
        endpoint=COMPLETIONS,
        dataset=f"trace:{trace}",
        vocab_low=VOCAB_LOW,
        vocab_high=vocab,
        seed=seed,
        ignore_eos=True,
        temperature=0.0,
        max_concurrency=concurrency,
        request_timeout_s=600.0,
        progress=False,
    )
    result = await run_benchmark(config)
    return sorted(result.records, key=lambda r: r.index)


def warm_up(url: str, vocab: int, threshold: int, window: int, workdir: Path) -> None:
    """Both prefill paths, a long prompt and a small concurrent burst, so the first timed
    requests do not pay first-call costs (allocations, kernel choices, socket set-up)."""
    long = min(window - 40, 1800)
    rows = [TraceRow(0.0, long, 8), TraceRow(0.0, max(8, threshold // 2), 16)]
    rows += [TraceRow(0.0, max(threshold, 8) + 32, 32), TraceRow(0.0, 24, 32)]
    seq = write_trace_csv(workdir / "warmup-seq.csv", rows)
    asyncio.run(replay(url, seq, vocab, seed=10**9 + 1, concurrency=1))
    burst = [TraceRow(0.05 * i, 24 + 60 * i, 24) for i in range(6)]
    asyncio.run(replay(url, write_trace_csv(workdir / "warmup-burst.csv", burst), vocab, 10**9 + 2))


class CpuAccount:
    """CPU seconds spent during one workload: by the server's process session (router, Ray,
    workers), by this client, and by everything else on the machine (other jobs sharing the
    cores: what the simulator cannot know about). System-wide busy time comes from the
    kernel's counters, so processes that came and went in between are counted too."""

    def __init__(self, server_sid: int) -> None:
        self.sid = server_sid
        self.me = psutil.Process()
        self.t0 = time.perf_counter()
        self.busy0 = _busy_s()
        self.server0 = self._server_s()
        self.me0 = _cpu_s(self.me)

    def _server_s(self) -> dict[int, float]:
        out = {}
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getsid(p.pid) == self.sid:
                    out[p.pid] = _cpu_s(p)
            except (psutil.Error, ProcessLookupError, PermissionError):
                continue
        return out

    def stop(self) -> dict[str, float]:
        wall = time.perf_counter() - self.t0
        busy = _busy_s() - self.busy0
        now = self._server_s()
        server = sum(v - self.server0.get(pid, 0.0) for pid, v in now.items())
        client = _cpu_s(self.me) - self.me0
        foreign = max(0.0, busy - server - client)
        cores = os.cpu_count() or 1
        return {
            "wall_s": wall,
            "busy_s": busy,
            "server_s": server,
            "client_s": client,
            "foreign_s": foreign,
            "foreign_cores": foreign / wall if wall > 0 else 0.0,
            "idle_cores": max(0.0, cores - busy / wall) if wall > 0 else 0.0,
        }


def _busy_s() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def _cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


class ForeignTimeline:
    """Other jobs' CPU cores over `interval_s` windows, sampled on a thread while a workload
    runs: when the machine was shared, and how much."""

    def __init__(self, server_sid: int, interval_s: float = 2.0) -> None:
        self.sid, self.interval_s = server_sid, interval_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="foreign-cpu", daemon=True)

    def _run(self) -> None:
        t0 = time.perf_counter()
        acc = CpuAccount(self.sid)
        while not self._stop.wait(self.interval_s):
            used = acc.stop()
            acc = CpuAccount(self.sid)
            self.samples.append((round(time.perf_counter() - t0, 1), used["foreign_cores"]))

    def __enter__(self) -> ForeignTimeline:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def wait_quiet(server_sid: int, max_cores: float, max_wait_s: float, window_s: float = 3.0):
    """Wait (up to max_wait_s) until other jobs use at most `max_cores` over `window_s`;
    returns (seconds waited, their cores in the last window)."""
    t0 = time.perf_counter()
    while True:
        acc = CpuAccount(server_sid)
        time.sleep(window_s)
        foreign = acc.stop()["foreign_cores"]
        waited = time.perf_counter() - t0
        if foreign <= max_cores or waited >= max_wait_s:
            return waited, foreign


# -- co-run interference ----------------------------------------------------------------------
@dataclass(slots=True)
class CorunShapes:
    """The calibration's requests: remote prompts of each of `probe_prompts` tokens (one output
    token: no hand-off), `probes` of them one at a time; local `local_prompt`-token requests
    decoding `decode_tokens` tokens in batches of each of `batches`; the other worker kept busy
    meanwhile by a loop of the other kind (local decodes in a batch of `busy_batch`, or remote
    prompts of `busy_prompt` tokens). Alone and beside alternate `rounds` times, so a drift of
    the machine hits both."""

    probe_prompts: tuple[int, ...]
    busy_prompt: int
    local_prompt: int
    batches: tuple[int, ...]
    busy_batch: int
    decode_tokens: int
    probes: int
    rounds: int

    @classmethod
    def for_server(cls, threshold: int, window: int, quick: bool) -> CorunShapes:
        if threshold < 2:
            raise ValueError("calibrating co-run needs local prefills: --disagg-threshold >= 2")
        top = window - 2
        probes = tuple(sorted({min(max(threshold, n), top) for n in (256, 512, 1024)}))
        local = max(1, min(32, threshold - 1))
        tokens, probes_n, rounds = (32, 2, 1) if quick else (128, 3, 2)
        return cls(probes, min(1536, top), local, (1, 4), 3, tokens, probes_n, rounds)


def calibrate_corun(
    url: str, vocab: int, shapes: CorunShapes, workdir: Path
) -> dict[str, list[tuple[int, float, float]]]:
    """How much slower each worker's steps are while the other computes: remote prefills'
    TTFT beside a decoding batch against alone, and decoding batches' TPOT beside a busy
    prefill worker against alone, as seen by the client:
    {"prefill": [(prompt, alone s, beside s)], "decode": [(batch, alone s, beside s)]}
    (medians; sim_validation.corun_slowdowns turns them into the simulator's slowdowns)."""
    seeds = iter(range(2 * 10**9, 3 * 10**9))
    s = shapes

    def trace(name: str, rows: list[TraceRow]) -> Path:
        return write_trace_csv(workdir / f"corun-{name}.csv", rows)

    async def ttft(prompt: int) -> list[float]:
        rows = [TraceRow(0.0, prompt, 1)] * s.probes
        records = await replay(url, trace(f"p{prompt}", rows), vocab, next(seeds), concurrency=1)
        return [r.ttft_s for r in records if r.ok]

    async def tpot(batch: int) -> list[float]:
        rows = [TraceRow(0.0, s.local_prompt, s.decode_tokens)] * batch
        records = await replay(url, trace(f"d{batch}", rows), vocab, next(seeds))
        return [r.tpot_s for r in records if r.ok]

    async def loop(other: Path, stop: asyncio.Event) -> None:
        while not stop.is_set():  # one trace at a time: a busy prefill, or a decoding batch
            await replay(url, other, vocab, next(seeds))

    async def pair(measure, other: Path) -> tuple[float, float]:
        alone, beside = [], []
        for _ in range(s.rounds):
            alone += await measure()
            stop = asyncio.Event()
            task = asyncio.create_task(loop(other, stop))
            await asyncio.sleep(0.3)  # the other worker is computing by now
            try:
                beside += await measure()
            finally:
                stop.set()
                await task
        return statistics.median(alone), statistics.median(beside)

    async def run() -> dict[str, list[tuple[int, float, float]]]:
        decoding = trace(
            "busy-decode", [TraceRow(0.0, s.local_prompt, s.decode_tokens)] * s.busy_batch
        )
        prefilling = trace("busy-prefill", [TraceRow(0.0, s.busy_prompt, 1)])
        pre = [(n, *await pair(lambda n=n: ttft(n), decoding)) for n in s.probe_prompts]
        dec = [(b, *await pair(lambda b=b: tpot(b), prefilling)) for b in s.batches]
        return {"prefill": pre, "decode": dec}

    return asyncio.run(run())
