"""Tensor parallelism's cost on this CPU: TP 2 against TP 1 step time, measured in one run.

Two steps of the engine (`LLMEngine.step`, fp32, the `small` llama: 8 layers, hidden 512, 8
query / 4 KV heads): one prefill of a 2,047-token prompt (the model's context is 2,048) in a
single step, and one decode step of 32 sequences. TP 1 runs with 2 torch threads and with 1;
TP 2 with 1 thread in each of its 2 ranks (OMP_NUM_THREADS=1 for the rank it starts), so it
uses the box's 2 cores. On 2 cores TP cannot be faster: each rank does half the GEMM work
with half the cores and adds a broadcast per step and two all-reduces per layer, so the
ratio measures the overhead, not a speed-up (that is a GPU figure: several devices' memory
bandwidth).

Usage: `python benchmarks/tp_cpu.py [--reps N] [--json PATH] [--quick]` (`--quick`: the tiny
model, a 500-token prompt).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import load_avg, log, machine_info, set_threads, write_json  # noqa: E402


def _engine(path, tp: int, threads: int):
    from engine.llm_engine import EngineConfig, LLMEngine

    set_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the ranks TP starts inherit it
    cfg = EngineConfig(
        model=str(path),
        dtype="float32",
        tensor_parallel_size=tp,
        max_num_batched_tokens=2048,
        num_kv_blocks=1024,
        max_num_seqs=64,
        enable_prefix_caching=False,
    )
    return LLMEngine(cfg)


def _prefill_step(engine, prompt: list[int], rid: str) -> float:
    from engine.protocol import SamplingParams

    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0))
    t0 = time.perf_counter()
    engine.step()
    dt = time.perf_counter() - t0
    assert not engine.has_unfinished()
    engine.pop_finished(rid)
    return dt


def _decode_steps(engine, prompts: list[list[int]], steps: int) -> list[float]:
    from engine.protocol import SamplingParams

    sp = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"d{i}", p, sp)
    engine.step()  # every prompt in one prefill step (32 x 64 tokens = the 2,048 budget)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for i in range(len(prompts)):
        engine.abort(f"d{i}")
    return times


def measure(path, tp: int, threads: int, prompt_len: int, reps: int) -> dict:
    import torch

    engine = _engine(path, tp, threads)
    try:
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(3, 1000, (prompt_len,), generator=g).tolist()
        _prefill_step(engine, prompt, "warm")
        prefill = [_prefill_step(engine, prompt, f"p{i}") for i in range(reps)]
        prompts = [torch.randint(3, 1000, (64,), generator=g).tolist() for _ in range(32)]
        decode = _decode_steps(engine, prompts, steps=8 * reps)
    finally:
        engine.shutdown()
    return {"prefill_s": statistics.median(prefill), "decode_step_s": statistics.median(decode)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from tools.make_model import cached_model

    preset, prompt_len = ("tiny", 500) if args.quick else ("small", 2047)
    path = cached_model("llama", preset, 0)
    load0 = load_avg()
    # TP 1 at 2 threads (the whole box) and at 1 (one rank's share), TP 2 at 1 per rank.
    runs = {"tp1x2": (1, 2), "tp1x1": (1, 1), "tp2x1": (2, 1)}
    results = {k: measure(path, tp, th, prompt_len, args.reps) for k, (tp, th) in runs.items()}
    names = (("prefill_s", f"prefill {prompt_len} tokens"), ("decode_step_s", "decode 32 seqs"))
    for key, name in names:
        a, b, c = (results[k][key] * 1e3 for k in runs)
        log(
            f"{name}: TP1 2 threads {a:.1f} ms, TP1 1 thread {b:.1f} ms, TP2 1 thread/rank "
            f"{c:.1f} ms; ratio TP2/TP1(2 threads) {c / a:.2f}, TP2/TP1(1 thread) {c / b:.2f}"
        )
    log(f"load average {load0:.2f} before, {load_avg():.2f} after (2 cores; shared box)")
    if args.json:
        write_json(args.json, {"machine": machine_info(2), "model": f"llama/{preset}",
                               "prompt_len": prompt_len, "results": results})  # fmt: skip


if __name__ == "__main__":
    main()
