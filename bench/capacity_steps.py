"""The timed parts of a capacity profile (bench/capacity.py runs them in this order):
`measure_prefill` on a prefill-role engine, `measure_decode` (the batch x context grid and its
fit) and `measure_mixed` on a decode-role engine, and `measure_transfer` (NIXL READs between
two processes). Each returns plain numbers and raw samples; nothing here writes a file.

Every engine step is timed alone (`step()` wall time, synchronized on a GPU) on prompts made
fresh for it, so the prefix cache never turns a measurement into a lookup.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

from bench.capacity_model import DecodeFit, fit_decode, fit_line

if TYPE_CHECKING:
    from bench.capacity_config import CapacityConfig, Log

# A decode cell the fit misses by more than this is timed again, up to RETIME_ROUNDS times.
OUTLIER = 0.10
RETIME_ROUNDS = 3


def _timed_step(engine: Any) -> tuple[float, list]:
    import torch

    t0 = time.perf_counter()
    outs = engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - t0, outs


class Prompts:
    """Fresh random prompts (ids above the special tokens), so the prefix cache finds nothing."""

    def __init__(self, seed: int, vocab: int) -> None:
        import numpy as np

        self.rng, self.vocab, self.n = np.random.default_rng(seed), vocab, 0

    def make(self, length: int) -> list[int]:
        return [int(t) for t in self.rng.integers(16, self.vocab, size=length)]

    def rid(self, kind: str) -> str:
        self.n += 1
        return f"{kind}-{self.n}"


# -- prefill ---------------------------------------------------------------------------------
def prefill_lengths(cfg: CapacityConfig, budget: int, window: int) -> tuple[int, ...]:
    """The prompt lengths to time: doubling from 16 to 256, then every 256 tokens (every 512
    above 1024), and the budget itself (or the longest prompt the window takes)."""
    top = min(budget, window - 1)
    if cfg.prefill_lengths is not None:
        return tuple(n for n in cfg.prefill_lengths if n <= top) or (top,)
    if cfg.quick:
        return tuple(sorted({min(16, top), min(64, top), top}))
    out, n = [], 16
    while n < top:
        out.append(n)
        n = n * 2 if n < 256 else n + 256 * (1 + (n >= 1024))
    return tuple(sorted({*out, top}))


def _prefill_once(engine: Any, prompts: Prompts, sizes: list[int]) -> float:
    """Seconds of the one step that prefills `sizes` prompts together (max_tokens 1)."""
    from engine.protocol import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ids = [prompts.rid("prefill") for _ in sizes]
    for rid, n in zip(ids, sizes, strict=True):
        engine.add_request(rid, prompts.make(n), one)
    elapsed, _ = _timed_step(engine)
    if engine.has_unfinished():
        raise RuntimeError(f"prompts of {sizes} tokens did not prefill in one step")
    for rid in ids:
        engine.pop_finished(rid)
    return elapsed


def measure_prefill(
    engine: Any, cfg: CapacityConfig, prompts: Prompts, log: Log
) -> tuple[list[tuple[int, float]], dict]:
    """(single-prompt points, raw measurements incl. the batched ones)."""
    budget = engine.scheduler.max_num_batched_tokens
    lengths = prefill_lengths(cfg, budget, engine.max_model_len)
    for n in (lengths[0], lengths[-1]):  # warm-up: workspaces, kernel choices
        _prefill_once(engine, prompts, [n])
    # Runs interleaved over the lengths: a neighbour's burst on a shared machine then hits one
    # run of several lengths, not every run of one.
    samples: dict[int, list[float]] = {n: [] for n in lengths}
    log(f"prefill: {len(lengths)} prompt lengths x {cfg.runs} run(s), interleaved")
    for _ in range(cfg.runs):
        for n in lengths:
            samples[n].append(_prefill_once(engine, prompts, [n]))
    single, batched, raw_single = [], [], []
    for n in lengths:
        med = statistics.median(samples[n])
        single.append((n, med))
        raw_single.append({"tokens": n, "median_s": med, "samples_s": samples[n]})
        line = f"prefill {n:>5} tokens, 1 prompt : {med * 1e3:8.1f} ms ({n / med:7.0f} tok/s)"
        k = budget // n
        if k >= 2 and n * k <= budget:
            bs = [_prefill_once(engine, prompts, [n] * k) for _ in range(cfg.runs)]
            bmed = statistics.median(bs)
            batched.append({"tokens": n * k, "prompts": k, "prompt_len": n, "median_s": bmed})
            line += f"; {k:>3} x {n}: {bmed * 1e3:8.1f} ms ({n * k / bmed:7.0f} tok/s)"
        log(line)
    return single, {"single": raw_single, "batched": batched}


# -- decode ----------------------------------------------------------------------------------
class InstantKV:
    """The decode engine's KV connector for profiling: a remote request's KV "lands" as soon as
    it is admitted (the cache keeps whatever it holds; a step's cost does not depend on it)."""

    def __init__(self) -> None:
        self.admitted: list[str] = []

    def on_prefilled(self, handoff: Any) -> bool:
        return False

    def on_remote_admitted(
        self, request_id: str, block_ids: list[int], num_reused_blocks: int
    ) -> None:
        self.admitted.append(request_id)


def decode_grid_cells(
    cfg: CapacityConfig, window: int, max_num_seqs: int, capacity_tokens: int, block_size: int
) -> list[tuple[int, int]]:
    """(batch, context per sequence) cells that fit the window, the KV cache and a step."""
    batches = cfg.batches or ((1, 4) if cfg.quick else (1, 2, 4, 8, 16, 32, 64))
    if cfg.contexts is not None:
        contexts = cfg.contexts
    elif cfg.quick:
        contexts = (16, 64)
    else:
        contexts = tuple(c for c in (16, 128, 256, 512, 1024, 1536) if c < window * 0.8)
        contexts = (*contexts, int(window * 0.85))
    grow = cfg.steps + 4  # tokens a cell adds per sequence (warm-up and timed steps)
    return [
        (b, c)
        for b in batches
        for c in contexts
        if b <= max_num_seqs
        and c + grow < window
        and b * (c + grow + block_size) <= capacity_tokens
    ]


def decode_grid(cfg: CapacityConfig, engine: Any) -> list[tuple[int, int]]:
    block = engine.config.block_size
    capacity = engine.block_manager.num_blocks * block
    return decode_grid_cells(cfg, engine.max_model_len, engine.config.max_num_seqs, capacity, block)


def _start_batch(engine: Any, prompts: Prompts, b: int, c: int, max_tokens: int) -> list[str]:
    """`b` sequences with `c`-token prompts whose KV arrives at once (InstantKV), decoding
    after one untimed warm-up step (the first step after a batch change)."""
    from engine.protocol import SamplingParams

    connector = engine.kv_connector
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [prompts.rid("decode") for _ in range(b)]
    for rid in ids:
        engine.add_remote_request(rid, prompts.make(c), 16, sp)
    engine.step()  # admits them: the connector records each
    for rid in connector.admitted:
        engine.commit_remote(rid)
    connector.admitted.clear()
    _timed_step(engine)
    return ids


def _decode_cell(
    engine: Any, prompts: Prompts, b: int, c: int, steps: int
) -> tuple[float, float, list[float]]:
    """Median seconds of `steps` decode steps of `b` sequences at context ~c, the mean total
    context those steps read, and every step's seconds."""
    ids = _start_batch(engine, prompts, b, c, steps + 8)
    times, contexts = [], []
    for _ in range(steps):
        contexts.append(sum(engine.seqs[r].num_tokens for r in ids))
        elapsed, outs = _timed_step(engine)
        if len(outs) != b:
            raise RuntimeError(f"a decode step of {b} sequences gave {len(outs)} tokens")
        times.append(elapsed)
    for rid in ids:
        engine.abort(rid)
    return statistics.median(times), statistics.fmean(contexts), times


def _time_cell(engine: Any, prompts: Prompts, b: int, c: int, steps: int) -> dict:
    med, ctx, times = _decode_cell(engine, prompts, b, c, steps)
    return {
        "batch": b,
        "context_per_seq": c,
        "context_tokens": ctx,
        "median_s": med,
        "steps_s": times,
        "timings": 1,
    }


def _fit_cells(cells: list[dict]) -> DecodeFit:
    fit = fit_decode([(x["batch"], x["context_tokens"], x["median_s"]) for x in cells])
    for x in cells:
        x["fit_s"] = fit.predict(x["batch"], x["context_tokens"])
    return fit


def _retime_outliers(
    engine: Any, cfg: CapacityConfig, prompts: Prompts, cells: list[dict], log: Log
) -> DecodeFit:
    """Fit, then time again the cells the fit misses by more than OUTLIER (a neighbour's
    burst on a shared machine only ever slows a step, so a cell keeps its fastest median),
    up to RETIME_ROUNDS times; returns the final fit."""
    fit = _fit_cells(cells)
    for _ in range(0 if cfg.quick else RETIME_ROUNDS):
        off = [x for x in cells if abs(x["fit_s"] - x["median_s"]) > OUTLIER * x["median_s"]]
        if not off:
            break
        log(f"decode: timing {len(off)} cell(s) the fit misses by > {OUTLIER:.0%} again")
        for x in off:
            again = _time_cell(engine, prompts, x["batch"], x["context_per_seq"], cfg.steps)
            x["timings"] += 1
            if again["median_s"] < x["median_s"]:
                x.update({k: again[k] for k in ("context_tokens", "median_s", "steps_s")})
        fit = _fit_cells(cells)
    return fit


def measure_decode(engine: Any, cfg: CapacityConfig, prompts: Prompts, log: Log) -> dict:
    """The grid's cells, timed and fitted; returns {"cells": [...], "fit": DecodeFit}."""
    engine.set_kv_connector(InstantKV())
    cells = []
    for b, c in decode_grid(cfg, engine):
        cells.append(_time_cell(engine, prompts, b, c, cfg.steps))
        log(f"decode batch {b:>3} x context {c:>5}: {cells[-1]['median_s'] * 1e3:8.2f} ms/step")
    if len(cells) < 3:
        raise ValueError(f"the decode grid has {len(cells)} cells that fit; need >= 3")
    fit = _retime_outliers(engine, cfg, prompts, cells, log)
    log(
        f"decode fit: {fit.fixed_s * 1e3:.3f} ms + {fit.per_seq_s * 1e3:.4f} ms/seq + "
        f"{fit.per_ctx_token_s * 1e6:.4f} us/context token; relative error mean "
        f"{fit.rel_err_mean:.1%}, p90 {fit.rel_err_p90:.1%}, max {fit.rel_err_max:.1%}"
    )
    return {"cells": cells, "fit": fit}


def measure_mixed(
    engine: Any, cells: list[tuple[int, int, int]], prompts: Prompts, steps: int
) -> list[dict]:
    """Steps that prefill a short prompt beside `batch` running decodes (serve's local
    prefill on a decode worker): (batch, context per seq, prompt) -> median seconds."""
    from engine.protocol import SamplingParams

    out = []
    greedy_one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for b, c, p in cells:
        ids = _start_batch(engine, prompts, b, c, steps + 8)
        times, ctxs = [], []
        for _ in range(steps):
            ctxs.append(sum(engine.seqs[r].num_tokens for r in ids))
            local = prompts.rid("local")
            engine.add_request(local, prompts.make(p), greedy_one)
            times.append(_timed_step(engine)[0])
            engine.pop_finished(local)
        for rid in ids:
            engine.abort(rid)
        out.append(
            {
                "batch": b,
                "context_tokens": statistics.fmean(ctxs),
                "prompt": p,
                "median_s": statistics.median(times),
            }
        )
    return out


# -- KV transfer -----------------------------------------------------------------------------
def measure_transfer(cfg: CapacityConfig, log: Log) -> dict:
    """Latency and bandwidth of one request's KV READ over NIXL, fitted over sizes from one
    block to 16 MiB. The layout is bench/kv_transfer.py's (the `small` preset's KV shape): the
    cost is a property of the transport and the bytes, which kv_bytes_per_token scales."""
    import torch

    from bench.kv_transfer import _Bench, _spec
    from engine.kv_cache import KVCache

    spec = _spec(cfg.kv_dtype)
    per_block = KVCache.bytes_per_block(spec)
    counts = (1, 8, 32) if cfg.quick else (1, 4, 16, 32, 64, 128)
    repeats = 3 if cfg.quick else 7
    threads = torch.get_num_threads()
    bench = _Bench(spec, 2 * max(counts) + 2, cfg.kv_dtype, 64 << 20)
    rows = []
    try:
        for n in counts:
            ids = list(range(0, 2 * n, 2))  # every other block: a fragmented cache
            bench.read_once(ids)  # untimed: faults the pages in
            lat = [bench.read_once(ids) for _ in range(repeats)]
            rows.append({"blocks": n, "bytes": n * per_block, "median_s": statistics.median(lat)})
    finally:
        bench.close()
        torch.set_num_threads(threads)  # the bench pins one thread for its copies
    latency, slope = fit_line([r["bytes"] for r in rows], [r["median_s"] for r in rows])
    if slope <= 0:  # no measurable growth with size: bound it by the largest transfer
        slope = rows[-1]["median_s"] / rows[-1]["bytes"]
    log(
        f"KV transfer (NIXL READ): {latency * 1e3:.3f} ms + {1 / slope / 1e9:.2f} GB/s "
        f"({', '.join(_transfer_point(r) for r in rows)})"
    )
    return {
        "latency_s": latency,
        "bytes_per_s": 1.0 / slope,
        "block_bytes": per_block,
        "points": rows,
    }


def _transfer_point(row: dict) -> str:
    return f"{row['blocks']} blk {row['median_s'] * 1e3:.2f} ms"
