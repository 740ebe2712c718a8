"""Prefill throughput against the measured bf16 GEMM peak, and FP8 W8A8 against bf16 on the
same Llama-3-8B-shaped model (dummy weights) and the same batches.

One engine step prefills `tokens` prompt tokens as 1024-token prompts (one step: the token
budget is 8192). Its FLOPs are the projections' (2 per weight per token; the head runs for the
last position of each prompt only) plus causal attention's; MFU is those FLOPs per second over
the bf16 GEMM peak measured in the same run. FP8 (`quantization="fp8"`: e4m3 weights with
per-channel scales, dynamic per-token activation scales, `torch._scaled_mm`) runs the same
batches; the goal is >= 1.5x bf16's tokens/s at >= 4096 tokens. Its accuracy proxy here is the
cosine of its logits with bf16's over one prompt (random weights: see benchmarks/README.md for
the trained-checkpoint bounds).

    python -m benchmarks.gpu.prefill --device cuda --out DIR        # writes DIR/prefill.json
"""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path

import torch

from benchmarks.gpu.common import (
    LLAMA3_8B,
    SMALL,
    gemm_peak,
    log,
    profile_top,
    section_args,
    stats,
    sync,
    timed,
    write_json,
    write_model_dir,
)  # fmt: skip

REPS = 3


def build_engine(path: Path, device, quantization: str | None, prompt_len: int):
    from engine.llm_engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(
        model=str(path), load_format="dummy", dtype="bfloat16", device=str(device),
        max_model_len=2 * prompt_len, max_num_seqs=16, max_num_batched_tokens=8192,
        enable_prefix_caching=False, enforce_eager=True, quantization=quantization,
    ))  # fmt: skip


def flops(engine, tokens: int, prompt_len: int) -> float:
    mc = engine.model_config
    h, kv, inter = mc.hidden_size, mc.num_kv_heads * mc.head_dim, mc.intermediate_size
    q = mc.num_heads * mc.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    prompts = tokens // prompt_len
    proj = 2 * per_layer * mc.num_layers * tokens + 2 * h * mc.vocab_size * prompts
    causal = prompt_len * (prompt_len + 1) / 2
    attn = 4 * causal * q * mc.num_layers * prompts  # QK^T and PV, 2 FLOPs per MAC
    return proj + attn


def prefill_step(engine, tokens: int, prompt_len: int, tag: list[int]):
    """Admit tokens/prompt_len fresh prompts and run the one step that prefills them all."""
    from engine.protocol import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i in range(tokens // prompt_len):
        tag[0] += 1
        ids = [(tag[0] * 7919 + j * 104729) % (vocab - 3) + 3 for j in range(prompt_len)]
        engine.add_request(f"p{tag[0]}-{i}", ids, sp)

    def run():
        outs = engine.step()
        assert len(outs) == tokens // prompt_len, "the batch did not fit one step"
        for o in outs:
            engine.pop_finished(o.request_id)

    return run


def measure(engine, sizes, prompt_len: int, device, peak: float) -> list[dict]:
    rows, tag = [], [0]
    for tokens in sizes:
        samples = []
        for _ in range(REPS + 1):  # the first is a warm-up (kernel selection, Triton compile)
            run = prefill_step(engine, tokens, prompt_len, tag)
            samples += timed(run, device, iters=1, warmup=0)
        t = stats(samples[1:])["median"]
        f = flops(engine, tokens, prompt_len)
        rows.append({"tokens": tokens, "seconds": t, "tokens_per_s": tokens / t,
                     "tflops": f / t / 1e12, "mfu": f / t / peak})  # fmt: skip
        log(f"prefill {engine.quantization} {tokens} tokens: {t * 1e3:.1f} ms, "
            f"{tokens / t:,.0f} tok/s, MFU {rows[-1]['mfu']:.2f}")  # fmt: skip
    run = prefill_step(engine, sizes[-1], prompt_len, tag)
    rows[-1]["profile"] = profile_top(run, device)
    return rows


def logits_of(engine, prompt_len: int) -> torch.Tensor:
    from engine.scoring import teacher_forced_logits

    vocab = engine.model_config.vocab_size
    ids = [(j * 7919) % (vocab - 3) + 3 for j in range(prompt_len)]
    return teacher_forced_logits(engine, ids)[-64:].cpu()


def run_mode(path, device, quantization, sizes, prompt_len, peak):
    engine = build_engine(path, device, quantization, prompt_len)
    try:
        rows = measure(engine, sizes, prompt_len, device, peak)
        return engine.quantization, rows, logits_of(engine, prompt_len)
    finally:
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv=None) -> None:
    args, device = section_args(__doc__, argv)
    shape, plen, sizes = (SMALL, 128, (256, 512)) if args.quick else (LLAMA3_8B, 1024, (4096, 8192))
    peak = gemm_peak(device, 256 if args.quick else 8192)
    result = {"device": str(device), "shape": shape, "prompt_len": plen, "gemm_bf16": peak}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model_dir(Path(tmp) / "llama3-8b-shape", shape)
        modes = {}
        for q in ("none", "fp8"):
            try:
                name, rows, logits = run_mode(path, device, q, sizes, plen, peak["tflops"] * 1e12)
                modes[q] = {"layout": name, "rows": rows, "logits": logits}
            except Exception as e:  # FP8 may be missing on a device: report, keep bf16
                log(f"prefill {q} failed: {e!r}")
                modes[q] = {"error": repr(e)[:500]}
    sync(device)
    result["bf16"] = {k: v for k, v in modes["none"].items() if k != "logits"}
    result["fp8"] = {k: v for k, v in modes["fp8"].items() if k != "logits"}
    if "rows" in modes["none"] and "rows" in modes["fp8"]:
        result["fp8_speedup"] = [
            {"tokens": a["tokens"], "ratio": b["tokens_per_s"] / a["tokens_per_s"]}
            for a, b in zip(modes["none"]["rows"], modes["fp8"]["rows"], strict=True)
        ]
        cos = torch.nn.functional.cosine_similarity(modes["none"]["logits"], modes["fp8"]["logits"])
        result["fp8_logits_cosine"] = {"mean": cos.mean().item(), "min": cos.min().item()}
        result["met_fp8"] = all(r["ratio"] >= 1.5 for r in result["fp8_speedup"])
        result["met_mfu"] = modes["none"]["rows"][-1]["mfu"] >= 0.60
    write_json(args.out, "prefill.json", result)


if __name__ == "__main__":
    main()
