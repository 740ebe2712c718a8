"""Batch-1 decode of a real model on CPU: tokens/s and the fraction of the memory bandwidth a
step uses, for each way tandem can run the step, in one run.

What a laptop user feels is the batch-1 decode step: it reads every weight once (the tied
embedding too, as the head), so its floor is bytes-per-step / read-stream bandwidth. The run:
- measures the single-thread read-stream bandwidth twice (fp32 `tensor.sum()` over 512 MiB of
  ordinary pages and of 2 MiB pages) and takes the better as the box's: the bound is strict;
- loads the model (default SmolLM2-135M-Instruct from `tandem fetch-model`) in bf16 (or int8
  projections and head with `--quantization int8`); its weights packed in one huge-page block
  (engine.models.weight_arena), as the engine always loads them on CPU;
- alternates `--rounds` rounds of each routing on the same engine, greedy, `--tokens` each:
  "torch" (every projection through torch's GEMM, the Python layer loop), "kernel" (1-3 row
  products through engine.kernels' GEMV, the Python layer loop) and "stack" (the C++ layer
  loop, engine.kernels.decode_stack: what the engine runs), and with `--compare-arena` a
  second engine loaded without the weight block ("stack, no arena");
- for each `--threads` count (default "1,2": llama.cpp is compared at 2) prints per-round
  decode tokens/s (1 / TPOT: the first token, the prompt's prefill, is not a decode step and
  is left out, as llama.cpp's eval rate and llamacpp_compare.py leave it out), ratios against
  "torch" and each routing's fraction of the bandwidth bound.

Usage: `python benchmarks/cpu_decode.py [--model PATH] [--rounds 3] [--tokens 64]
[--threads 1,2] [--quantization int8|int8-w8a8] [--compare-arena] [--json PATH]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import load_avg, log, machine_info, set_threads, write_json  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def step_bytes(model) -> int:
    """Bytes a batch-1 step reads from its weights: every projection and norm, the head once
    (the embedding row lookup is negligible, and a tied head is counted once)."""
    import torch

    seen, total = set(), 0
    embed = model.model.embed_tokens.weight
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t is None or t.data_ptr() in seen or not isinstance(t, torch.Tensor):
            continue
        if t.data_ptr() == embed.data_ptr() and model.lm_head.weight is not embed:
            continue  # untied: the embedding table is only indexed
        if "rope_" in name:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def routings(model):
    """{name: function that switches every projection to it} for this engine's model."""
    from engine import kernels
    from engine.models import llama
    from engine.models.linear import Linear

    ops = kernels.ops()
    linears = [m for m in model.modules() if isinstance(m, Linear)]

    def use(cpu_ops, int8_ops, stack: bool):
        def apply():
            for m in linears:
                m.cpu_ops, m.gemv_only, m.widen_fallback = cpu_ops, True, False
                if m.scheme == "int8":
                    m.int8_ops = int8_ops
            # UNBUILT: rebuilt for the routing just set; None: the Python layer loop.
            model._decode_stack = llama.UNBUILT if stack else None

        return apply

    if ops is None or ops.gemv is None:
        raise SystemExit(
            "engine.kernels' GEMV is not available on this CPU (needs AVX-512 or AVX2+FMA)"
        )
    return {
        "torch": use(None, None, False),
        "kernel": use(ops, ops, False),
        "stack": use(ops, ops, True),
    }


def measure_bandwidth(mib: int) -> dict:
    """The best single-thread fp32 `sum()` read rate over ordinary and over 2 MiB pages."""
    import torch

    from benchmarks.roofline import measure_read_bandwidth
    from engine.models.weight_arena import huge_page_bytes

    set_threads(1)
    plain = measure_read_bandwidth(mib, 5)["best_bytes_per_s"]
    x = huge_page_bytes(mib * 2**20).view(torch.float32).fill_(1.0)
    best = min(_timed(x.sum) for _ in range(5))
    huge = x.numel() * 4 / best
    return {"plain_pages": plain, "huge_pages": huge, "best": max(plain, huge)}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def load_engines(args) -> dict:
    """{label: LLM}: the engine as it loads (weights in one block), and with `--compare-arena`
    one loaded with TANDEM_WEIGHT_ARENA=0."""
    import os

    from engine.llm import LLM

    settings = {"dtype": "bfloat16", "num_kv_blocks": 64}
    if args.quantization:
        settings["quantization"] = args.quantization
    engines = {"": LLM(args.model, **settings)}
    if args.compare_arena:
        os.environ["TANDEM_WEIGHT_ARENA"] = "0"
        try:
            engines[", no arena"] = LLM(args.model, **settings)
        finally:
            del os.environ["TANDEM_WEIGHT_ARENA"]
    return engines


def run(args) -> dict:
    import torch

    from engine.protocol import SamplingParams

    bw = measure_bandwidth(args.bandwidth_mib)
    log(
        f"read-stream bandwidth, 1 thread: {bw['plain_pages'] / 1e9:.1f} GB/s (4 KiB pages), "
        f"{bw['huge_pages'] / 1e9:.1f} GB/s (2 MiB pages)"
    )
    engines = load_engines(args)
    nbytes = step_bytes(engines[""].engine.model)
    bound = nbytes / bw["best"]
    log(f"{nbytes / 1e6:.1f} MB read a step -> bound {bound * 1e3:.2f} ms ({1 / bound:.0f} tok/s)")
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    switches = {}
    for label, llm in engines.items():
        for name, apply in routings(llm.engine.model).items():
            if not label or name == "stack":
                switches[name + label] = (llm, apply)
    by_threads, texts = {}, {}
    with torch.inference_mode():
        for threads in args.threads:
            set_threads(threads)
            by_threads[threads] = _rounds(args, switches, greedy, texts, threads)
    result = {
        "machine": machine_info(max(args.threads)),
        "load_avg": load_avg(),
        "model": str(args.model),
        "quantization": args.quantization or "none (bf16)",
        "read_bandwidth_bytes_per_s": bw,
        "step_bytes": nbytes,
        "bound_s": bound,
        "tokens": args.tokens,
        "threads": {},
        "same_text_kernel_stack": texts.get("kernel") == texts.get("stack"),
    }
    for threads, rounds in by_threads.items():
        result["threads"][str(threads)] = summarize(rounds, bound)
        for k, v in result["threads"][str(threads)]["fraction_of_bound"].items():
            med = 1 / statistics.median(rounds[k])
            log(f"{threads} thread(s), {k}: median {med:.1f} tok/s, {v:.2f} of the bound")
    return result


def _rounds(args, switches, greedy, texts, threads) -> dict[str, list[float]]:
    """Seconds per token for each routing, `args.rounds` alternated rounds."""
    rounds: dict[str, list[float]] = {name: [] for name in switches}
    for llm, apply in switches.values():  # warm-up: first calls, lazy allocations
        apply()
        llm.generate([PROMPT], type(greedy)(max_tokens=4, temperature=0.0))
    for r in range(args.rounds):
        for name, (llm, apply) in switches.items():
            apply()
            out = llm.generate([PROMPT], greedy)[0]
            # The first token is the prefill's; the rest are decode steps: seconds per output
            # token after the first (TPOT), what llamacpp_compare.py and llama.cpp report.
            rounds[name].append(out.tpot)
            texts[name] = out.text
        log(
            f"{threads} thread(s), round {r + 1}: "
            + ", ".join(f"{k} {1 / v[-1]:.1f}" for k, v in rounds.items())
            + " tok/s"
        )
    return rounds


def summarize(rounds: dict[str, list[float]], bound: float) -> dict:
    """Per-round tokens/s, each routing's per-round speed-up over "torch", fraction of bound."""
    base = rounds["torch"]
    return {
        "seconds_per_token": rounds,
        "speedup_vs_torch_per_round": {
            k: [b / t for b, t in zip(base, v, strict=True)] for k, v in rounds.items()
        },
        "fraction_of_bound": {k: bound / statistics.median(v) for k, v in rounds.items()},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory or GGUF (default: SmolLM2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--quantization", choices=("int8", "int8-w8a8"), default=None)
    p.add_argument("--bandwidth-mib", type=int, default=512, help="size of the read-stream probe")
    p.add_argument("--compare-arena", action="store_true", help="also load without the block")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.tokens < 2:
        p.error("--tokens must be at least 2 (the rate is measured after the first token)")
    args.threads = [int(t) for t in str(args.threads).split(",")]
    if args.model is None:
        from tools.real_model import model_path

        args.model = str(model_path())
    result = run(args)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
