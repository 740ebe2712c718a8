"""`tandem profile --capacity`: measure one prefill and one decode worker on this machine and
write the `CapacityProfile` (bench/capacity_profile.py) the planner and the simulator read.

Each worker is measured as `tandem serve` runs it: one `LLMEngine` in this process on one
worker's share of the cores (`--threads`, default 1), with serve's engine defaults (bfloat16,
prefix caching and chunked prefill on, a 2048-token step budget, 256 sequences, the KV cache
sized as serve sizes it) and its per-pool quantization flags. Lifecycle of a run
(`profile_capacity`):

1. startup: the wall time of a fresh `python -c "import torch, engine..., kv_transfer..."`
   (what a new worker process imports) plus the time to build each engine (load the model,
   allocate the KV cache);
2. prefill (the prefill-role engine): fresh random prompts (prefix caching finds nothing), each
   run timed as the one `step()` that computes it: single prompts of lengths 16 .. the step
   budget, and batches of equal prompts that fill the budget. The single-prompt medians are
   the profile's `prefill_points` (an idle worker's TTFT, and an upper bound for a batched
   step of as many tokens, which has less attention); the batched ones go to `measurements`;
3. decode (the decode-role engine): a grid of batch size x context per sequence. The prompts'
   KV "arrives" at once (a KV connector that commits every remote request as soon as it is
   admitted, the decode worker's own path minus the READ), so a cell costs only its decode
   steps; each cell's median step time, with the batch's total context, feeds a non-negative
   least-squares fit (bench/capacity_model.py, relative error) of decode_fixed_s,
   decode_per_seq_s and decode_per_ctx_token_s. A few mixed steps (a short prompt prefilled
   beside running decodes, serve's local prefill) are timed against the model's prediction;
4. KV transfer: real NIXL READs between two agents in two processes (bench/kv_transfer.py's
   receiver/sender pair), over a range of sizes, fitted to latency + bytes / bandwidth;
   kv_bytes_per_token is the engine's own block layout (KV dtype and FP8 scales included);
5. with `--live`, `tandem serve --prefill 1 --decode 1` with the same engine flags answers
   sequential requests, and what the engine does not explain becomes request_overhead_s and
   token_overhead_s (bench/capacity_live.py); without it they are 0, and a note says so;
6. the profile (source "measured") is written as JSON (`--capacity-out`).

The timed parts live in bench/capacity_steps.py, the fits and the idle-request timeline in
bench/capacity_model.py, the live part in bench/capacity_live.py.

Flags shared with the latency profile (`--model`, `--dtype`, `--threads`, `--seed`,
`--load-format`, `--attention-backend`, `--repeats`) keep their names; the rest are generated
from `CapacityConfig`. The default model is the demo's cached `small` Llama
(`tools.make_model.cached_model`: 8 layers, hidden 512, GQA 8/4 heads, vocab 8192, context
2048), the model `tandem profile`, the demo and benchmarks/compare_disagg.py use.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.capacity_config import (
    DEFAULT_OUT_DIR,
    SERVE_DTYPE,
    SHARED_FLAGS,
    CapacityConfig,
    Log,
)
from bench.capacity_profile import CapacityProfile
from bench.capacity_steps import (
    Prompts,
    measure_decode,
    measure_mixed,
    measure_prefill,
    measure_transfer,
)
from engine.config_flags import add_flags, values_from_args

# What a new worker process imports before it can build its engine. Ray's placement of the
# actor is not in it: with --live, tandem serve's own start time replaces the estimate when
# it is longer.
WORKER_IMPORTS = "import torch, engine.llm_engine, kv_transfer.agent"


# -- engines ---------------------------------------------------------------------------------
def engine_config(cfg: CapacityConfig, role: str) -> Any:
    """The EngineConfig of a worker of `role`, as tandem serve builds it from the same flags."""
    from engine.llm_engine import EngineConfig
    from engine.roles import PREFILL

    quant = cfg.prefill_quantization if role == PREFILL else cfg.decode_quantization
    return EngineConfig(
        model=cfg.model,
        dtype=cfg.dtype,
        load_format=cfg.load_format,
        block_size=cfg.block_size,
        num_kv_blocks=cfg.num_kv_blocks,
        kv_cache_memory_gb=cfg.kv_cache_memory_gb,
        kv_host_cache_gb=cfg.kv_host_cache_gb,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
        attention_backend=cfg.attention_backend,
        kv_dtype=cfg.kv_dtype,
        quantization=quant,
        seed=cfg.seed,
        role=role,
        tensor_parallel_size=cfg.tp,
        # Steps are timed one at a time, synced, and their tokens read per step: decode-ahead
        # (whose gain is between steps, and whose tokens come a step later) stays off.
        decode_ahead="off",
    )


def build_engine(cfg: CapacityConfig, role: str) -> tuple[Any, float]:
    """(engine, seconds to build it: model load and KV cache allocation)."""
    from engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(engine_config(cfg, role))
    return engine, time.perf_counter() - t0


def process_start_s(repeats: int = 3) -> float:
    """Median wall time of a fresh interpreter importing what a worker imports."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", WORKER_IMPORTS], check=True, cwd=root, env=env)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


# -- the profile -----------------------------------------------------------------------------
def _hardware(threads: int) -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    cpu = "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {threads} thread(s) per worker"


def _measure_workers(cfg: CapacityConfig, log: Log) -> dict:
    """Build and time a prefill then a decode worker's engine (one at a time, as each would be
    alone in its process); everything the profile needs from the engines."""
    import gc

    from engine.kv_cache import KVCache
    from engine.roles import DECODE, PREFILL

    engine, build_prefill_s = build_engine(cfg, PREFILL)
    prompts = Prompts(cfg.seed, engine.model_config.vocab_size)
    log(f"prefill worker built in {build_prefill_s:.2f} s")
    points, prefill_raw = measure_prefill(engine, cfg, prompts, log)
    del engine
    gc.collect()
    engine, build_decode_s = build_engine(cfg, DECODE)
    log(f"decode worker built in {build_decode_s:.2f} s")
    decode = measure_decode(engine, cfg, prompts, log)
    # Serve's local prefill: a short prompt beside running decodes (checked, not fitted).
    mixed_cells = [(1, 16, 16)] if cfg.quick else [(1, 256, 64), (8, 256, 64), (8, 256, 192)]
    mixed = measure_mixed(engine, mixed_cells, prompts, cfg.steps)
    spec = engine.kv_spec
    return {
        "prefill_points": points,
        "prefill": prefill_raw,
        "decode": decode,
        "mixed": mixed,
        "kv_bytes_per_token": KVCache.bytes_per_block(spec) // spec.block_size,
        "kv_capacity_tokens": engine.block_manager.num_blocks * spec.block_size,
        "max_batch_tokens": engine.scheduler.max_num_batched_tokens,
        "max_num_seqs": engine.config.max_num_seqs,
        "build_s": {"prefill": build_prefill_s, "decode": build_decode_s},
        "device": engine.device.type,
    }


def _assemble(cfg: CapacityConfig, w: dict, transfer: dict, process_s: float) -> CapacityProfile:
    fit = w["decode"]["fit"]
    startup = process_s + max(w["build_s"].values())
    measurements = {
        "config": {k: getattr(cfg, k) for k in cfg.__slots__},
        "prefill": w["prefill"],
        "decode_grid": w["decode"]["cells"],
        "decode_fit": fit.to_dict(),
        "transfer": transfer,
        "device": w["device"],
        "startup": {
            "process_s": process_s,
            "engine_build_s": w["build_s"],
            "imports": WORKER_IMPORTS,
        },
        "notes": [
            "prefill_points are single prompts (an idle worker's TTFT); a batched step of as "
            "many tokens is cheaper (less attention): see prefill.batched",
            "transfer is measured on bench/kv_transfer.py's KV layout; bytes scale by "
            "kv_bytes_per_token",
        ],
    }
    profile = CapacityProfile(
        model=Path(cfg.model).name,
        hardware=cfg.hardware or _hardware(cfg.threads),
        source="measured",
        prefill_points=w["prefill_points"],
        decode_fixed_s=fit.fixed_s,
        decode_per_seq_s=fit.per_seq_s,
        decode_per_ctx_token_s=fit.per_ctx_token_s,
        kv_bytes_per_token=w["kv_bytes_per_token"],
        transfer_latency_s=transfer["latency_s"],
        transfer_bytes_per_s=transfer["bytes_per_s"],
        kv_capacity_tokens=w["kv_capacity_tokens"],
        max_batch_tokens=w["max_batch_tokens"],
        max_num_seqs=w["max_num_seqs"],
        startup_s=startup,
        gpus_per_worker=cfg.tp,  # a profile of a TP-N worker plans in workers of N GPUs
        measurements=measurements,
    )
    for m in w["mixed"]:
        m["model_s"] = profile.mixed_step_s(m["prompt"], m["batch"], m["context_tokens"])
    measurements["mixed"] = w["mixed"]
    return profile


def profile_capacity(cfg: CapacityConfig, log: Log = print) -> CapacityProfile:
    """Measure this machine's workers (module docstring) and return the profile, overheads
    included when `cfg.live`."""
    import torch

    torch.set_num_threads(cfg.threads)
    log(
        f"capacity profile: {Path(cfg.model).name}, {cfg.dtype}, {cfg.threads} thread(s), "
        f"load {os.getloadavg()[0]:.2f}{', quick' if cfg.quick else ''}"
    )
    process_s = process_start_s(1 if cfg.quick else 3)
    log(f"worker process start (imports): {process_s:.2f} s")
    workers = _measure_workers(cfg, log)
    transfer = measure_transfer(cfg, log)
    profile = _assemble(cfg, workers, transfer, process_s)
    profile.measurements["load_avg_1_5_15"] = list(os.getloadavg())
    if not cfg.live:
        profile.measurements["notes"].append(
            "request_overhead_s and token_overhead_s are 0: measured only with --live"
        )
        return profile
    from bench.capacity_live import apply_live_overheads

    return apply_live_overheads(cfg, profile, log)


# -- CLI -------------------------------------------------------------------------------------
class _Unset(str):
    """The shared `--dtype` flag's default: the latency profile reads it as the plain string
    (float32), a capacity run as "not given" (then tandem serve's dtype). argparse cannot tell
    an unset flag from its default otherwise."""

    __slots__ = ()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The capacity flags, beside the latency profile's (bench/profile.py adds `--capacity`)."""
    add_flags(p, CapacityConfig, title="capacity profile (with --capacity)", exclude=SHARED_FLAGS)
    for action in p._actions:
        if action.dest == "dtype" and isinstance(action.default, str):
            parse = action.type or str
            # argparse passes a string default through `type`: keep the marker through it.
            action.type = lambda text, parse=parse: (
                text if isinstance(text, _Unset) else parse(text)
            )
            action.default = _Unset(action.default)
            action.help = f"{action.help}; with --capacity: {SERVE_DTYPE}, as tandem serve"


def config_from_args(args: argparse.Namespace) -> CapacityConfig:
    model = args.model
    if model is None:
        from tools.make_model import cached_model

        model = str(cached_model(seed=args.seed))
    values = values_from_args(CapacityConfig, args, exclude=SHARED_FLAGS)
    shared = {name: getattr(args, name) for name in SHARED_FLAGS if name != "model"}
    if isinstance(shared["dtype"], _Unset):
        shared["dtype"] = SERVE_DTYPE
    return CapacityConfig(model=str(model), **shared, **values)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
        profile = profile_capacity(cfg, log=lambda m: print(m, flush=True))
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"tandem profile --capacity: {e}", file=sys.stderr)
        return 2
    device = profile.measurements.get("device", "cpu")
    out = Path(cfg.capacity_out or f"{DEFAULT_OUT_DIR}/capacity-{device}.json")
    profile.save(out)
    print(summary(profile))
    print(f"wrote {out}")
    return 0


def summary(profile: CapacityProfile) -> str:
    """The profile's key numbers, one per line."""
    p = profile
    lines = [
        f"{p.model} on {p.hardware} ({p.source})",
        f"  prefill: {p.prefill_tokens_per_s():.0f} tok/s at {p.max_batch_tokens} tokens; "
        f"{p.prefill_s(256) * 1e3:.1f} ms for 256",
        f"  decode step: {p.decode_fixed_s * 1e3:.3f} ms + {p.decode_per_seq_s * 1e3:.4f} ms/seq"
        f" + {p.decode_per_ctx_token_s * 1e6:.4f} us/context token",
        f"  KV: {p.kv_bytes_per_token} B/token, {p.kv_capacity_tokens} tokens per worker; "
        f"transfer {p.transfer_latency_s * 1e3:.3f} ms + {p.transfer_bytes_per_s / 1e9:.2f} GB/s",
        f"  overheads: request {p.request_overhead_s * 1e3:.2f} ms, "
        f"token {p.token_overhead_s * 1e3:.3f} ms; startup {p.startup_s:.1f} s",
    ]
    return "\n".join(lines)
