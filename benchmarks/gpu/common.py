"""What every section of the GPU run shares: the device, timers that sync it, the measured
ceilings (device-to-device copy bandwidth, GEMM peaks) the results are ratios against, the
Llama-3-8B-shaped config the speed sections load with dummy weights, and a profile summary."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

# Llama-3-8B's shape (meta-llama/Meta-Llama-3-8B config.json); the quick CPU run uses SMALL.
LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
    max_position_embeddings=8192, rms_norm_eps=1e-5,
)  # fmt: skip
SMALL = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, vocab_size=2048, rope_theta=500000.0,
    max_position_embeddings=4096, rms_norm_eps=1e-5,
)  # fmt: skip


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_json(out_dir: str | Path, name: str, obj: dict) -> Path:
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    log(f"wrote {path}")
    return path


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 2) -> list:
    """Seconds per call, each call synced (wall clock: includes the host's share)."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def stats(samples: list[float]) -> dict:
    return {"min": min(samples), "median": statistics.median(samples), "n": len(samples)}


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 10) -> dict:
    """A device-to-device copy: GB/s counting bytes read plus bytes written (the ceiling a
    kernel that streams its inputs once can approach), and bytes moved once."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    t = stats(timed(lambda: b.copy_(a), device, iters))["min"]
    return {"bytes": nbytes, "seconds": t, "rw_gb_per_s": 2 * nbytes / t / 1e9,
            "copy_gb_per_s": nbytes / t / 1e9}  # fmt: skip


def gemm_peak(device: torch.device, n: int, fp8: bool = False, iters: int = 10) -> dict:
    """TFLOP/s of an n x n x n product: bf16, or FP8 e4m3 with row-wise scales (the W8A8
    layers' own call, torch._scaled_mm)."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, generator=g, device=device).to(torch.bfloat16)
    if fp8:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # column-major B
        sa = torch.ones(n, 1, device=device)
        sb = torch.ones(1, n, device=device)
        fn = lambda: torch._scaled_mm(a8, b8, sa, sb, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        fn = lambda: a @ b  # noqa: E731
    t = stats(timed(fn, device, iters))["min"]
    return {"n": n, "dtype": "fp8_e4m3" if fp8 else "bfloat16", "seconds": t,
            "tflops": 2 * n**3 / t / 1e12}  # fmt: skip


def write_model_dir(path: Path, shape: dict) -> Path:
    """A config.json only (no weights, no tokenizer): engines load it with load_format=dummy."""
    from transformers import LlamaConfig

    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(**shape, tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(path)
    return path


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads from the weights: every parameter and buffer of the layers and
    the head; the embedding table only when the head is tied to it (a lookup reads one row)."""
    seen, total = set(), 0
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen or name.startswith("rope_") or (t is embed and not tied):
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def profile_top(fn: Callable[[], object], device: torch.device, top: int = 12) -> dict:
    """One profiled run of `fn`: the kernels (or CPU ops) that took the most time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)
    return {
        "sort": key,
        "rows": [
            {"name": e.key[:90], "calls": e.count, "us": round(getattr(e, key, 0), 1)}
            for e in rows[:top]
        ],
        "cpu_total_us": round(sum(e.self_cpu_time_total for e in prof.key_averages()), 1),
    }


def python_profile(fn: Callable[[], object], top: int = 15) -> dict:
    """One run of `fn` under cProfile: this thread's Python functions by their own time (what
    the host does while the GPU waits: a decode step's scheduling and bookkeeping, a READ's
    polls)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return {
        "seconds": round(sum(v[2] for v in stats.values()), 6),
        "by_own_time": [
            {
                "function": f"{Path(f).name}:{line}({name})",
                "calls": nc,
                "own_s": round(tt, 6),
                "cumulative_s": round(ct, 6),
            }
            for (f, line, name), (_, nc, tt, ct, _) in rows
        ],
    }


def section_args(doc: str, argv=None):
    """The flags every section takes: --device, --quick (the CPU dry run's small shapes),
    --out (the results folder)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    return args, device_from(args.device)


def device_from(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    return torch.device(name)


def env_threads() -> None:
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
