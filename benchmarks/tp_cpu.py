"""Tensor parallelism's cost on this CPU: TP 2 against TP 1 step time, measured in one run.

Two steps of the engine (`LLMEngine.step`, fp32, the `small` llama: 8 layers, hidden 512, 8
query / 4 KV heads): one prefill of a 2,047-token prompt (the model's context is 2,048) in a
single step, and one decode step of 32 sequences. TP 1 runs with 2 torch threads and with 1;
TP 2 with 1 thread in each of its 2 ranks (OMP_NUM_THREADS=1 for the rank it starts), so it
uses the box's 2 cores. On 2 cores TP cannot be faster: each rank does half the GEMM work
with half the cores and adds a broadcast per step and two all-reduces per layer, so the
ratio measures the overhead, not a speed-up (that is a GPU figure: several devices' memory
bandwidth).

`--handoff`: the KV hand-off for the (P, D) pairs (1, 1), (2, 1), (4, 1), (1, 2), (2, 2),
(1, 4) (real engines and worker loops, every rank in its own process with its own NIXL agent;
the tiny llama, 2 KV heads: at TP 4 the heads are replicated, read from one holder each, and
at D4 each decode rank reads its own copy): READ time per request (the decode agent's
`seconds / transfers`, from start_read to the landing of rank 0's last slice, which is
posted after every other decode rank's READs landed), bytes read by all decode ranks, and
NIXL rows per block of rank 0, each against the (P1, D1) baseline measured in the same run.

Usage: `python benchmarks/tp_cpu.py [--reps N] [--json PATH] [--quick] [--handoff]`
(`--quick`: the tiny model, a 500-token prompt).
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


def handoff(path, tp: int, dtp: int, prompts: list[list[int]]) -> dict:
    """Prefill `prompts` on a TP `tp` prefill worker, hand them to a fresh TP `dtp` decode
    worker."""
    import zmq

    from decode_worker.server import decode_server
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.protocol import PrefillRequest, SamplingParams, TokenMessage, decode, encode
    from kv_transfer.agent import KVTransferAgent
    from prefill_worker.server import prefill_server

    kw = dict(model=str(path), dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)
    pe = LLMEngine(EngineConfig(**kw, role="prefill", tensor_parallel_size=tp))
    de = LLMEngine(EngineConfig(**kw, role="decode", tensor_parallel_size=dtp))
    p = prefill_server(f"p{tp}", pe, KVTransferAgent(f"p{tp}", pe.cache, tp_group=pe.tp))
    d = decode_server(f"d{tp}", de, KVTransferAgent(f"d{tp}", de.cache, tp_group=de.tp))
    ctx = zmq.Context()
    sink, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    sink.bind("tcp://127.0.0.1:*")
    p.start()
    d.start()
    push.connect(p.endpoint)
    try:
        sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        reply = sink.getsockopt(zmq.LAST_ENDPOINT).decode()
        for i, prompt in enumerate(prompts):  # one at a time: each READ timed on its own
            push.send(encode(PrefillRequest(f"r{i}", prompt, sp, reply, d.worker_id, d.endpoint)))
            while True:
                m = decode(sink.recv(), expect=TokenMessage)
                assert m.finish_reason != "error", m.error
                if m.finish_reason and m.request_id == f"r{i}":
                    break
        stats = d.connector.agent.stats()
        peer = next(iter(d.connector.agent._receiver._peers.values()))
        rows = 1 if peer.plan is None else peer.plan.rows_per_block()
        assert d.connector.num_recomputed == 0 and stats.transfers == len(prompts)
        return {"read_ms": stats.seconds / stats.transfers * 1e3,
                "bytes": stats.bytes_read, "rows_per_block": rows}  # fmt: skip
    finally:
        p.stop()
        d.stop()
        pe.shutdown()
        de.shutdown()
        sink.close(0)
        push.close(0)
        ctx.term()


def main_handoff(args) -> None:
    import torch

    from tools.make_model import cached_model

    path = cached_model("llama", "tiny", 0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (512,), generator=g).tolist() for _ in range(args.reps * 4)]
    load0 = load_avg()
    pairs = ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4))
    results = {f"P{tp},D{dtp}": handoff(path, tp, dtp, prompts) for tp, dtp in pairs}
    base = results["P1,D1"]
    for pair, r in results.items():
        log(
            f"{pair}: READ {r['read_ms']:.2f} ms/request (x{r['read_ms'] / base['read_ms']:.2f} "
            f"of P1,D1), {r['bytes']} bytes (x{r['bytes'] / base['bytes']:.2f}), "
            f"{r['rows_per_block']} NIXL rows per block"
        )
    log(f"{len(prompts)} prompts of 512 tokens; load average {load0:.2f} before, "
        f"{load_avg():.2f} after (2 cores; shared box)")  # fmt: skip
    if args.json:
        write_json(args.json, {"machine": machine_info(2), "model": "llama/tiny",
                               "results": results})  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--handoff", action="store_true")
    args = ap.parse_args()
    if args.handoff:
        main_handoff(args)
        return
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
