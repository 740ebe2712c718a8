"""The part of a request's latency the engine does not explain, measured on a live `tandem
serve`: `apply_live_overheads(cfg, profile)` fills a measured profile's request_overhead_s and
token_overhead_s (and its startup_s, when the live start took longer).

Lifecycle: start `tandem serve --prefill 1 --decode 1` with the profile's engine flags and the
disaggregation threshold (`LiveServer`: local Ray, real actors, ZMQ, NIXL, HTTP) -> warm-up
requests -> sequential requests (one at a time, so the workers are idle when each arrives),
timed by the `tandem bench serve` client (bench/client.py: TTFT to the first content chunk,
TPOT = (E2E - TTFT) / (output - 1)): max_tokens 1 at several prompt lengths for TTFT, long
outputs at a few prompt lengths for TPOT, prompts on both sides of the threshold (a shorter
prompt is prefilled on the decode worker) -> SIGTERM, drain, stop.

For each request the engine's share is what the profile predicts for it on idle workers
(bench/capacity_model.py `idle_request` with the overheads at 0: prefill steps for TTFT; KV
hand-off plus decode steps for TPOT), and the rest is overhead: router parsing and routing,
ZMQ hops, worker loop wake-ups, detokenization, the SSE stream. The groups' median TTFTs are
fitted as request_overhead_s + prefill_scale x the engine's prefill (a served prefill shares
the machine with the router and the other worker; the profile's prefill_points are scaled by
it), token_overhead_s is the median of the groups' TPOT residuals; every point is kept under
measurements["live"].
"""

from __future__ import annotations

import asyncio
import os
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from bench.capacity_model import idle_request, nnls
from bench.capacity_profile import CapacityProfile

if TYPE_CHECKING:
    from bench.capacity_config import CapacityConfig, Log

_START_LINE = re.compile(r"\(([0-9.]+)s to start\)")
# A served prefill slower or faster than the in-process one by more than this is not
# believed (a burst on a shared machine during one group, not a property of serving).
PREFILL_SCALE_RANGE = (0.8, 1.5)


def serve_flags(cfg: CapacityConfig) -> list[str]:
    """`tandem serve` flags that run the workers the profile measured."""
    flags = ["--prefill", "1", "--decode", "1", "--num-cpus", str(2 * cfg.threads * cfg.tp)]
    flags += ["--prefill-tp", str(cfg.tp), "--decode-tp", str(cfg.tp)]
    flags += ["--disagg-threshold", str(cfg.disagg_threshold)]
    flags += ["--prefill-quantization", cfg.prefill_quantization]
    flags += ["--decode-quantization", cfg.decode_quantization]
    for name in (
        "dtype",
        "block_size",
        "max_num_batched_tokens",
        "max_num_seqs",
        "kv_dtype",
        "seed",
        "load_format",
        "attention_backend",
        "kv_cache_memory_gb",
        "num_kv_blocks",
        "kv_host_cache_gb",
        "max_model_len",
    ):
        value = getattr(cfg, name)
        if value is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


def live_plan(cfg: CapacityConfig, window: int) -> tuple[list[int], list[tuple[int, int]], int]:
    """(TTFT prompt lengths, (prompt, output) pairs for TPOT, requests per point)."""
    if cfg.quick:  # one prompt on each side of the threshold
        long = min(window - 9, max(cfg.disagg_threshold, 64))
        return [16, long], [(long, 8)], cfg.live_requests or 1
    top = min(window - 1, 1536)
    ttft = sorted({n for n in (32, 128, 320, 768, top) if n < window})
    tpot = [(n, 128) for n in (64, 320, 1024) if n + 128 < window]
    return ttft, tpot or [(16, min(64, window - 17))], cfg.live_requests or 5


async def _sequential(url: str, prompt: int, output: int, n: int, seed: int) -> list:
    from bench.client import run_benchmark
    from bench.config import BenchConfig

    config = BenchConfig(
        base_url=url,
        num_prompts=n,
        input_len=prompt,
        output_len=output,
        max_concurrency=1,
        seed=seed,
        progress=False,
    )
    result = await run_benchmark(config)
    return result.records


async def _interleaved(url: str, plan: list[tuple[int, int]], n: int, log: Log) -> list[list]:
    """`n` rounds of one request per (prompt, output) of `plan`, one at a time, after a
    warm-up; a neighbour's burst on a shared machine then touches one round of every group
    rather than every request of one. Each request has a new seed: no prefix-cache hits."""
    seeds = iter(range(1000, 10**6))
    for prompt in (max(plan)[0], min(plan)[0]):  # warm-up: lazy allocations, first kernels
        await _sequential(url, prompt, 4, 1, next(seeds))
    out: list[list] = [[] for _ in plan]
    for r in range(n):
        for i, (prompt, output) in enumerate(plan):
            out[i] += await _sequential(url, prompt, output, 1, next(seeds))
        log(f"live: round {r + 1}/{n} of {len(plan)} requests")
    return out


def _residuals(profile: CapacityProfile, threshold: int, records: list, output: int) -> dict:
    """Measured vs the engine's share for one group of equal requests."""
    ok = [r for r in records if r.error is None]
    prompt = ok[0].prompt_len if ok else records[0].prompt_len
    disagg = prompt >= threshold
    engine = idle_request(profile, prompt, output, disagg)
    row = {
        "prompt": prompt,
        "output": output,
        "path": "disagg" if disagg else "local",
        "requests": len(records),
        "failed": [r.error for r in records if r.error is not None],
        "engine_ttft_s": engine.engine_ttft_s,
        "ttft_s": [r.ttft_s for r in ok],
    }
    if ok:
        row["ttft_residual_s"] = statistics.median(r.ttft_s for r in ok) - engine.engine_ttft_s
    if output > 1 and ok:
        row["engine_tpot_s"] = engine.engine_tpot_s
        row["tpot_s"] = [r.tpot_s for r in ok]
        row["tpot_residual_s"] = statistics.median(r.tpot_s for r in ok) - engine.engine_tpot_s
    return row


def measure_live(cfg: CapacityConfig, bare: CapacityProfile, window: int, log: Log) -> dict:
    """Start the server, send the plan's requests, stop; every group's residuals."""
    from bench.live_server import LiveServer

    ttft_lengths, tpot_pairs, n = live_plan(cfg, window)
    workdir = Path(tempfile.mkdtemp(prefix="tandem-capacity-live-"))
    server = LiveServer(cfg.model, workdir, *serve_flags(cfg))
    log(f"live: starting tandem serve --prefill 1 --decode 1 (log {server.log_path})")
    t0 = time.perf_counter()
    server.start()
    start_wall_s = time.perf_counter() - t0
    plan = [(p, 1) for p in ttft_lengths] + list(tpot_pairs)
    load = [os.getloadavg()[0]]
    try:
        records = asyncio.run(_interleaved(server.url, plan, n, log))
    finally:
        rc = server.stop()
    load.append(os.getloadavg()[0])
    groups = []
    for (_, output), got in zip(plan, records, strict=True):
        groups.append(_residuals(bare, cfg.disagg_threshold, got, output))
        log(_describe(groups[-1]))
    found = _START_LINE.findall(server.log_text())
    return {
        "groups": groups,
        "serve_start_wall_s": start_wall_s,
        "serve_reported_start_s": float(found[-1]) if found else None,
        "serve_exit_code": rc,
        "serve_flags": serve_flags(cfg),
        "load_avg_1min_start_end": load,
    }


def _describe(row: dict) -> str:
    text = f"live: prompt {row['prompt']:>5} ({row['path']:<6}) output {row['output']:>4}:"
    if "ttft_residual_s" in row:
        ttft = statistics.median(row["ttft_s"])
        text += f" TTFT {ttft * 1e3:7.1f} ms (engine {row['engine_ttft_s'] * 1e3:7.1f})"
    if "tpot_residual_s" in row:
        tpot = statistics.median(row["tpot_s"])
        text += f" TPOT {tpot * 1e3:6.2f} ms (engine {row['engine_tpot_s'] * 1e3:6.2f})"
    if row["failed"]:
        text += f" {len(row['failed'])} failed: {row['failed'][0]}"
    return text


@dataclass(slots=True)
class LiveFit:
    """What the live requests say about the profile: TTFT = request_overhead_s +
    prefill_scale x the engine's prefill (a served prefill may run a little slower than the
    in-process one: the router and the other worker share the machine), and each later token
    pays token_overhead_s beyond the engine's decode step."""

    request_overhead_s: float
    prefill_scale: float
    token_overhead_s: float
    notes: list[str]


def fit_overheads(groups: list[dict]) -> LiveFit:
    """The TTFT line (relative least squares of the groups' medians on the engine's prefill; a
    slope outside PREFILL_SCALE_RANGE is not trusted: then slope 1 and the same relative fit of
    the fixed part alone) and the median TPOT residual over the groups; overheads never below
    0."""
    notes = []
    ttft = [g for g in groups if "ttft_residual_s" in g]
    tpot = [g["tpot_residual_s"] for g in groups if "tpot_residual_s" in g]
    if not ttft or not tpot:
        raise RuntimeError("the live requests gave no TTFT or no TPOT")
    engine = [g["engine_ttft_s"] for g in ttft]
    served = [g["engine_ttft_s"] + g["ttft_residual_s"] for g in ttft]
    request_s, scale = 0.0, 0.0
    if len(set(engine)) > 1:
        # Relative least squares: the short prompts pin the fixed part, which an absolute fit
        # would leave to the noise of the long ones.
        rows = [[1.0 / y, x / y] for x, y in zip(engine, served, strict=True)]
        request_s, scale = nnls(rows, [1.0] * len(rows))
    lo, hi = PREFILL_SCALE_RANGE
    if not lo <= scale <= hi:
        notes.append(f"live prefill slope {scale:.3f} outside {PREFILL_SCALE_RANGE}: not used")
        request_s, scale = _fixed_part_at_slope_one(engine, served), 1.0
    token_s = statistics.median(tpot)
    for name, value in (("request", request_s), ("token", token_s)):
        if value < 0:
            notes.append(f"live {name} overhead {value * 1e3:.3f} ms < 0: clamped to 0")
    return LiveFit(max(request_s, 0.0), scale, max(token_s, 0.0), notes)


def _fixed_part_at_slope_one(engine: list[float], served: list[float]) -> float:
    """argmin_r sum(((r + x - y) / y)^2): the residuals weighted by 1 / served^2, so that the
    short prompts, whose TTFT is mostly the fixed part, decide it. A plain median would let
    the long prompts' noise (a served prefill a little faster or slower than the in-process
    one) outvote them and swing the fixed part below zero."""
    weights = [1.0 / (y * y) for y in served]
    residuals = [y - x for x, y in zip(engine, served, strict=True)]
    return sum(w * e for w, e in zip(weights, residuals, strict=True)) / sum(weights)


def apply_live_overheads(
    cfg: CapacityConfig, profile: CapacityProfile, log: Log
) -> CapacityProfile:
    """The profile with the live overheads (and a live start time when that is longer)."""
    from engine.config import ModelConfig

    window = ModelConfig.from_pretrained(cfg.model).max_position
    if cfg.max_model_len:
        window = min(window, cfg.max_model_len)
    bare = replace(profile, request_overhead_s=0.0, token_overhead_s=0.0)
    live = measure_live(cfg, bare, window, log)
    fit = fit_overheads(live["groups"])
    notes = list(fit.notes)
    live["prefill_scale"] = fit.prefill_scale
    if fit.prefill_scale != 1.0:
        notes.append(
            f"prefill_points are the engine's x {fit.prefill_scale:.3f}, the served/engine "
            "TTFT slope of the live requests (engine-only: measurements.prefill.single)"
        )
    startup = profile.startup_s
    reported = live["serve_reported_start_s"]
    if reported is not None and reported > startup:
        # Workers start in parallel under Ray; the deployment's own start is the closest
        # measured figure for a new worker actor (process, imports, engine, sockets).
        startup = reported
        notes.append("startup_s: tandem serve's reported start (controller, workers, router)")
    measurements = dict(profile.measurements)
    measurements["live"] = live
    measurements["notes"] = [*measurements.get("notes", []), *notes]
    log(
        f"live: TTFT = {fit.request_overhead_s * 1e3:.2f} ms + {fit.prefill_scale:.3f} x engine "
        f"prefill; {fit.token_overhead_s * 1e3:.3f} ms per later token"
    )
    return replace(
        profile,
        prefill_points=[(t, s * fit.prefill_scale) for t, s in profile.prefill_points],
        request_overhead_s=fit.request_overhead_s,
        token_overhead_s=fit.token_overhead_s,
        startup_s=startup,
        measurements=measurements,
    )
