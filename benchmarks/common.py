"""Helpers shared by the benchmark scripts: where their model checkpoints are cached, the
machine description, timing, and JSON output.

The checkpoint comes from `tools.make_model.cached_model(arch, preset, cache_dir=CACHE_DIR)`
(seeded random weights written as a real Hugging Face directory), so tandem and transformers
load byte-identical weights. It is made once and cached under `benchmarks/.cache/` (ignored by
the repository's .gitignore).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE_DIR = REPO / "benchmarks" / ".cache"

if str(REPO) not in sys.path:  # allow `python benchmarks/x.py` from anywhere
    sys.path.insert(0, str(REPO))


def set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def machine_info(threads: int) -> dict:
    """What a reader needs to judge the numbers: CPU, cores, load, library versions."""
    import torch
    import transformers

    model, flags = platform.processor() or "unknown", set()
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    for line in lines:
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return {
        "cpu": model,
        "logical_cpus": os.cpu_count(),
        "torch_threads": threads,
        "native_bf16_isa": sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile"}),
        "load_avg_1_5_15": list(os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def load_avg() -> float:
    return os.getloadavg()[0]


def time_calls(fn: Callable[[], object], iters: int, warmup: int = 2) -> list[float]:
    """Wall seconds of `iters` calls of fn after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def summarize(samples: list[float]) -> dict:
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "n": len(samples),
    }


def write_json(path: str | os.PathLike, obj: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def log(msg: str) -> None:
    """Progress line (flushed, so a long run shows where it is)."""
    print(msg, flush=True)
