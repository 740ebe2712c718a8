"""Batch-1 decode of a real model on CPU: tokens/s and the fraction of the memory bandwidth a
step uses, with the projections on torch's GEMM against tandem's GEMV kernel, in one run.

What a laptop user feels is the batch-1 decode step: it reads every weight once (the tied
embedding too, as the head), so its floor is bytes-per-step / read-stream bandwidth. The run:
- measures the single-thread read-stream bandwidth (fp32 `tensor.sum()` over 512 MiB: what
  llama.cpp-class engines reach ~0.8 of);
- loads the model (default SmolLM2-135M-Instruct from `tandem fetch-model`) in bf16 (or int8
  decode projections with `--quantization int8`) on one thread;
- alternates `--rounds` rounds of "torch" (every projection through torch's GEMM) and "kernel"
  (1-3 row products through engine.kernels' GEMV, what the engine picks on a CPU with native
  bf16) on the same engine, greedy, `--tokens` each, and prints per-round tokens/s, their ratio
  and each one's fraction of the bandwidth bound.

Usage: `python benchmarks/cpu_decode.py [--model PATH] [--rounds 3] [--tokens 64]
[--quantization int8] [--json PATH]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import load_avg, log, machine_info, set_threads, write_json  # noqa: E402
from benchmarks.roofline import measure_read_bandwidth  # noqa: E402

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
    from engine.models.linear import Linear

    ops = kernels.ops()
    linears = [m for m in model.modules() if isinstance(m, Linear)]

    def use(cpu_ops, int8_ops):
        def apply():
            for m in linears:
                m.cpu_ops, m.gemv_only, m.widen_fallback = cpu_ops, True, False
                if m.scheme == "int8":
                    m.int8_ops = int8_ops

        return apply

    if ops is None or ops.gemv is None:
        raise SystemExit("engine.kernels' GEMV is not available on this CPU (AVX-512 needed)")
    return {"torch": use(None, None), "kernel": use(ops, ops)}


def run(args) -> dict:
    import torch

    from engine.llm import LLM
    from engine.protocol import SamplingParams

    set_threads(args.threads)
    bw = measure_read_bandwidth(args.bandwidth_mib, 5)["best_bytes_per_s"]
    log(f"read-stream bandwidth: {bw / 1e9:.1f} GB/s (fp32 sum over {args.bandwidth_mib} MiB)")
    settings = {"dtype": "bfloat16", "num_kv_blocks": 64}
    if args.quantization:
        settings["quantization"] = args.quantization
    llm = LLM(args.model, **settings)
    model = llm.engine.model
    nbytes = step_bytes(model)
    bound = nbytes / bw
    log(f"{nbytes / 1e6:.1f} MB read a step -> bound {bound * 1e3:.2f} ms ({1 / bound:.0f} tok/s)")
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    switch = routings(model)
    rounds: dict[str, list[float]] = {name: [] for name in switch}
    texts = {}
    with torch.inference_mode():
        for apply in switch.values():  # warm-up: first calls, lazy allocations
            apply()
            llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0))
        for r in range(args.rounds):
            for name, apply in switch.items():
                apply()
                t0 = time.perf_counter()
                out = llm.generate([PROMPT], greedy)[0]
                # The first token is the prefill's; the rest are decode steps.
                per_token = (time.perf_counter() - t0) / args.tokens
                rounds[name].append(per_token)
                texts[name] = out.text
            log(
                f"round {r + 1}: torch {1 / rounds['torch'][-1]:.1f} tok/s, kernel "
                f"{1 / rounds['kernel'][-1]:.1f} tok/s "
                f"({rounds['torch'][-1] / rounds['kernel'][-1]:.2f}x)"
            )
    result = {
        "machine": machine_info(args.threads),
        "load_avg": load_avg(),
        "model": str(args.model),
        "quantization": args.quantization or "none (bf16)",
        "read_bandwidth_bytes_per_s": bw,
        "step_bytes": nbytes,
        "bound_s": bound,
        "tokens": args.tokens,
        "rounds": {k: v for k, v in rounds.items()},
        "ratio_per_round": [t / k for t, k in zip(rounds["torch"], rounds["kernel"], strict=True)],
        "fraction_of_bound": {k: bound / statistics.median(v) for k, v in rounds.items()},
        "same_text": texts["torch"] == texts["kernel"],
    }
    for k, v in result["fraction_of_bound"].items():
        log(f"{k}: median {1 / statistics.median(rounds[k]):.1f} tok/s, {v:.2f} of the bound")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory or GGUF (default: SmolLM2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quantization", choices=("int8",), default=None)
    p.add_argument("--bandwidth-mib", type=int, default=512, help="size of the read-stream probe")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.model is None:
        from tools.real_model import model_path

        args.model = str(model_path())
    result = run(args)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
