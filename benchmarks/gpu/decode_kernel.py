"""The paged decode kernel alone, over its split length, key block and warps: which shape reads a
Llama-3-8B layer's KV fastest at batch 1 and 32 (decode.py's rows, 1k-token contexts).

Run 6 (H200) put the kernel at 0.29 ms a step at batch 1 for 134 MB of KV (0.46 TB/s: 64
programs of 128 tokens, 8 KV heads x 8 splits, on 132 SMs) and at 1.47 ms for 4.3 GB at batch
32 (2.9 TB/s). The step's time is what a decode step replays, so each variant is timed as
a CUDA graph of one call per layer over 32 layers' own caches (no layer's KV is left in L2
for the next), replayed; the grid's bound on the context is the step's longest (eager) or the
model's maximum (a graph's), where splits past the context exit at once. Every variant's
output is checked against the default's. Reported: microseconds per step and the KV read
rate; written into decode.json as `kernel_sweep` (decode.py calls `sweep`).

On CPU (`--quick`) the same code runs tiny shapes under Triton's interpreter, which checks
the plumbing and the outputs, not the speed.
"""

from __future__ import annotations

import torch

from benchmarks.gpu.common import log, stats, sync, timed

# (split_len, block_n, num_warps or None for Triton's 4); (128, 128, None) is the kernel's
# default for 128-wide heads since run 7 (run 6 had 32 keys; run 7 swept split and block
# only: 128/128 best at batch 1, 256/64 2% ahead at batch 32). Run 8 adds the warp count and
# 512-token splits (batch 32 has programs to spare: fewer, longer ones may stream better).
VARIANTS = [(64, 64, None), (128, 32, None), (128, 128, None), (256, 64, None),
            (256, 128, None), (512, 128, None),
            (128, 64, 2), (128, 128, 8), (256, 128, 8), (512, 128, 8)]  # fmt: skip
# The interpreter is slow: the plumbing only.
QUICK_VARIANTS = [(32, 32, None), (64, 64, None), (128, 32, None), (128, 64, 2)]
FULL = {"layers": 32, "kv_heads": 8, "heads": 32, "dim": 128, "block": 16, "ctx": 1024}
QUICK = {"layers": 2, "kv_heads": 2, "heads": 4, "dim": 16, "block": 4, "ctx": 40}
REPLAYS, WARMUP = 20, 3


def _case(spec: dict, batch: int, device, seed: int = 0) -> dict:
    """One decode step's inputs for every layer: q, the paged K/V caches, tables, lengths."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    per_seq = -(-spec["ctx"] // spec["block"])
    blocks = batch * per_seq
    shape = (blocks, spec["block"], spec["kv_heads"], spec["dim"])

    def rand(*s):
        return torch.randn(*s, generator=g).to(device, torch.bfloat16)

    layers = [(rand(*shape), rand(*shape)) for _ in range(spec["layers"])]
    tables = torch.randperm(blocks, generator=g).view(batch, per_seq).to(device, torch.int32)
    lens = torch.full((batch,), spec["ctx"], dtype=torch.int32, device=device)
    q = rand(batch, spec["heads"], spec["dim"])
    kv_bytes = 2 * spec["layers"] * batch * spec["ctx"] * spec["kv_heads"] * spec["dim"] * 2
    return {"q": q, "layers": layers, "tables": tables, "lens": lens, "kv_bytes": kv_bytes}


def _step(case: dict, max_context: int, split: int, block_n: int, warps=None) -> list:
    from engine.kernels.triton_attention import paged_decode

    scale = case["q"].shape[-1] ** -0.5
    return [
        paged_decode(
            case["q"],
            kc,
            vc,
            case["tables"],
            case["lens"],
            scale,
            None,
            max_context,
            split_len=split,
            block_n=block_n,
            num_warps=warps,
        )
        for kc, vc in case["layers"]
    ]


def _seconds(fn, device) -> float:
    """Median seconds of one call of `fn`: a replayed CUDA graph of it on a GPU (0 on CPU,
    where it is only run once: the interpreter's time says nothing)."""
    if device.type != "cuda":
        fn()
        return 0.0
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return stats(timed(graph.replay, device, REPLAYS, WARMUP))["median"]


def _variants(case: dict, batch: int, bounds: list[int], variants, device) -> list[dict]:
    """One row per (variant, grid bound): its step time and how far its output is from the
    default variant's."""
    from engine.kernels.triton_attention import SPLIT_LEN, default_block_n

    reference = _step(case, bounds[0], SPLIT_LEN, default_block_n(case["q"].shape[-1]))
    rows = []
    for split, block_n, warps in variants:
        for max_context in bounds:

            def step(max_context=max_context, split=split, block_n=block_n, warps=warps):
                return _step(case, max_context, split, block_n, warps)

            diff = max((a.float() - b.float()).abs().max().item()
                       for a, b in zip(step(), reference, strict=True))  # fmt: skip
            seconds = _seconds(step, device)
            rows.append({"batch": batch, "split_len": split, "block_n": block_n,
                         "num_warps": warps or 4, "max_context": max_context,
                         "step_us": seconds * 1e6,
                         "kv_gb_per_s": case["kv_bytes"] / seconds / 1e9 if seconds else None,
                         "max_abs_diff": diff})  # fmt: skip
    return rows


def sweep(device, quick: bool) -> dict:
    spec = QUICK if quick else FULL
    rows = []
    for batch in (1, 3) if quick else (1, 32):
        case = _case(spec, batch, device)
        bounds = [spec["ctx"], 2 * spec["ctx"]] + ([8 * spec["ctx"]] if batch == 1 else [])
        rows += _variants(case, batch, bounds, QUICK_VARIANTS if quick else VARIANTS, device)
        del case  # 4.3 GB at batch 32: freed before the next batch's
        sync(device)
    best = {}
    for batch in sorted({r["batch"] for r in rows}):
        mine = [r for r in rows if r["batch"] == batch and r["step_us"] > 0]
        if mine:
            top = min(mine, key=lambda r: r["step_us"])
            keys = ("split_len", "block_n", "num_warps", "max_context", "step_us")
            best[str(batch)] = {k: top[k] for k in keys}
            log(f"paged decode batch {batch}: best split {top['split_len']} block "
                f"{top['block_n']} warps {top['num_warps']} at "
                f"{top['step_us']:.0f} us/step")  # fmt: skip
    worst_diff = max(r["max_abs_diff"] for r in rows)
    return {"spec": spec, "rows": rows, "best": best, "max_abs_diff": worst_diff,
            "outputs_agree": worst_diff < 0.05}  # fmt: skip
