"""Decode at the memory-bandwidth limit: a Llama-3-8B-shaped model (dummy weights, bf16) at
batch 1 and 32 with 1k-token contexts, with decode steps replayed from CUDA graphs and eagerly.

A decode step must read every weight once and each sequence's KV; its bandwidth-bound time is
those bytes over the card's measured copy bandwidth (bytes read plus written, as a streaming
kernel moves them), measured in the same run. Reported per batch: the whole engine step
(schedule, inputs, forward, sampling: what a user sees as TPOT) with graphs and eagerly, the
graph replay alone, the MBU of each (bound / measured time) and a profile of each mode; the
steady step (back-to-back steps, one sync at the end, as a serving loop runs them) with
decode-ahead (engine.decode_ahead: step N+1 launched before N's tokens are read back) and
without; then the paged decode kernel alone over its split length, key block and warps
(decode_kernel.py). Goals, on the steady step: MBU >= 0.70 at batch 1; batch 32 within 1.3x
of its bound.

    python -m benchmarks.gpu.decode --device cuda --out DIR          # writes DIR/decode.json
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from benchmarks.gpu.common import (
    LLAMA3_8B,
    SMALL,
    copy_bandwidth,
    log,
    profile_top,
    python_profile,
    section_args,
    stats,
    sync,
    timed,
    weight_bytes,
    write_json,
    write_model_dir,
)  # fmt: skip

WARMUP, STEPS = 3, 20
# Tokens each request decodes: every timed and profiled step of measure_batch, with room.
DECODE_TOKENS = 12 * (WARMUP + STEPS) + 16


def build_engine(path: Path, device, max_num_seqs: int, max_model_len: int):
    from engine.llm_engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(
        model=str(path), load_format="dummy", dtype="bfloat16", device=str(device),
        max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
        enable_prefix_caching=False,
        decode_ahead="on",  # "auto" would too on CUDA with graphs; "on": the CPU dry run too
    ))  # fmt: skip


def admit(engine, batch: int, ctx: int, max_tokens: int) -> list[str]:
    """`batch` requests of `ctx` prompt tokens, stepped until every one is decoding."""
    from engine.protocol import SamplingParams

    g = torch.Generator().manual_seed(batch)
    vocab = engine.model_config.vocab_size
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    rids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in rids:
        engine.add_request(rid, torch.randint(3, vocab, (ctx,), generator=g).tolist(), sp)
    started: set[str] = set()
    while len(started) < batch:
        started |= {o.request_id for o in engine.step() if o.token_ids}
    return rids


def kv_bytes(engine, batch: int, ctx: int) -> int:
    spec = engine.kv_spec
    per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim
    return batch * ctx * per_token * torch.empty((), dtype=spec.cache_dtype).element_size()


def replay_seconds(engine, batch: int, device) -> float | None:
    graphs = engine.runner.graphs
    if graphs is None or not graphs.graphs:
        return None
    graph = graphs.graphs[graphs.bucket_for(batch)]
    return stats(timed(graph.replay, device, STEPS))["median"]


def steady_seconds(engine, device, steps: int = STEPS, repeats: int = 3) -> float:
    """Seconds per step over `steps` back-to-back steps, synced once at the end, as a serving
    loop runs them (a sync per step would hide what decode-ahead overlaps); median of
    `repeats`. The step left in flight is read back inside the timed span."""

    def run() -> None:
        for _ in range(steps):
            engine.step()
        engine.ahead.drain()

    return stats(timed(run, device, repeats, warmup=0))["median"] / steps


def ahead_rows(engine, device) -> dict:
    """Steady-state steps with decode-ahead (engine.decode_ahead) and without, same run."""
    ahead, launched = engine.ahead, engine.ahead.launched
    row = {"decode_ahead": ahead.enabled, "step_steady_s": steady_seconds(engine, device)}
    row["ahead_launched"] = ahead.launched - launched
    ahead.enabled = False
    try:
        row["step_steady_no_ahead_s"] = steady_seconds(engine, device)
    finally:
        ahead.enabled = row["decode_ahead"]
    return row


def measure_batch(engine, batch: int, ctx: int, device, bandwidth: float) -> dict:
    rids = admit(engine, batch, ctx, max_tokens=DECODE_TOKENS)
    graphs = engine.runner.graphs
    row = {"batch": batch, "context": ctx}
    row["bytes"] = weight_bytes(engine.model) + kv_bytes(engine, batch, ctx)
    row["bound_s"] = row["bytes"] / bandwidth
    row["step_graphs_s"] = stats(timed(engine.step, device, STEPS, WARMUP))["median"]
    row |= ahead_rows(engine, device)
    row["replay_s"] = replay_seconds(engine, batch, device)
    row["profile_graphs"] = profile_top(lambda: [engine.step() for _ in range(3)], device)
    # The host's share of a graphed step (step minus replay): which Python functions, per step.
    row["host_profile_graphs"] = python_profile(lambda: [engine.step() for _ in range(3)])
    engine.runner.graphs = None
    try:
        row["step_eager_s"] = stats(timed(engine.step, device, STEPS, WARMUP))["median"]
        row["profile_eager"] = profile_top(lambda: [engine.step() for _ in range(3)], device)
    finally:
        engine.runner.graphs = graphs
    for rid in rids:
        engine.abort(rid)
    for key in ("step_graphs", "step_steady", "step_steady_no_ahead", "step_eager", "replay"):
        t = row[f"{key}_s"]
        row[f"mbu_{key}"] = None if t is None else row["bound_s"] / t
    row["graphs_speedup"] = row["step_eager_s"] / row["step_graphs_s"]
    log(f"decode batch {batch}: step {row['step_graphs_s'] * 1e3:.2f} ms with graphs "
        f"(MBU {row['mbu_step_graphs']:.2f}), {row['step_eager_s'] * 1e3:.2f} ms eager; "
        f"steady {row['step_steady_s'] * 1e3:.2f} ms with decode-ahead, "
        f"{row['step_steady_no_ahead_s'] * 1e3:.2f} without; "
        f"bound {row['bound_s'] * 1e3:.2f} ms")  # fmt: skip
    return row


def main(argv=None) -> None:
    args, device = section_args(__doc__, argv)
    if device.type == "cpu":  # the kernel sweep's Triton kernels run on CPU tensors so
        os.environ["TRITON_INTERPRET"] = "1"  # (set before anything imports them)
    shape, ctx, batches = (SMALL, 64, (1, 4)) if args.quick else (LLAMA3_8B, 1024, (1, 32))
    bw = copy_bandwidth(device, (64 if args.quick else 2048) * 2**20)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model_dir(Path(tmp) / "llama3-8b-shape", shape)
        # 2k at 1k contexts, as runs 1-7 (the graphs' attention grid is sized for it).
        engine = build_engine(path, device, max(batches), max(2 * ctx, ctx + DECODE_TOKENS + 16))
        graphs = engine.runner.graphs
        rows = [measure_batch(engine, b, ctx, device, bw["rw_gb_per_s"] * 1e9) for b in batches]
    sync(device)
    from benchmarks.gpu.decode_kernel import sweep

    kernel_sweep = sweep(device, args.quick)
    b1, bn = rows[0], rows[-1]
    write_json(args.out, "decode.json", {
        "device": str(device), "shape": shape, "copy": bw, "rows": rows,
        "kernel_sweep": kernel_sweep,
        "graph_sizes": None if graphs is None else graphs.sizes,
        "graph_replays": None if graphs is None else graphs.replays,
        # The goals on the steady step (a serving loop's), as run 7's on the synced one.
        "goal_batch1_mbu": 0.70, "met_batch1": (b1["mbu_step_steady"] or 0) >= 0.70,
        "goal_batchN_over_bound": 1.3, "met_batchN": bn["step_steady_s"] <= 1.3 * bn["bound_s"],
    })  # fmt: skip


if __name__ == "__main__":
    main()
