"""Weight bytes, prefill speed and decode step time per quantization mode, on this machine.

    python benchmarks/quant_speed.py            # `small` llama, every mode (~3 min on 2 cores)
    python benchmarks/quant_speed.py --quick    # tiny model, a smoke run

Each mode loads the same checkpoint into one engine and measures, in the same run as the
baseline (bf16, no quantization), so the ratios compare like with like:
- the bytes of the decoder projections (the weights quantization touches) and of the whole
  model's parameters and buffers;
- prefill: `--prefill-batch` prompts of `--prompt-len` tokens through `LLM.generate` with one
  output token, as tokens/s (the prefill pool's work);
- decode: `--decode-batch` sequences generating `--decode-steps` + 1 tokens, minus the prefill
  of the same prompts, per step (the decode pool's work).
Modes: bf16, fp32, and the quantized layouts (int8, fp8 = W8A8, fp8-weight-only) in the
`--dtype` activation dtype. Medians of `--repeats` runs. Accuracy is quant_accuracy.py's.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import CACHE_DIR, log, machine_info, set_threads, write_json  # noqa: E402
from tools.make_model import cached_model  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "quant_speed.json"
QUANT_MODES = ("int8", "fp8", "fp8-weight-only")


def projection_bytes(model) -> tuple[int, int]:
    """(bytes of the decoder layers' projection weights and scales, bytes of everything)."""
    from engine.models.linear import Linear

    proj = 0
    for mod in model.model.layers.modules():
        if isinstance(mod, Linear):
            proj += sum(t.numel() * t.element_size() for t in mod.parameters(recurse=False))
            proj += sum(t.numel() * t.element_size() for t in mod.buffers(recurse=False))
    tensors = list(model.parameters()) + list(model.buffers())
    total = sum(t.numel() * t.element_size() for t in tensors)
    return proj, total


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(n)]


def _timed(llm, prompts, max_tokens: int) -> float:
    from engine import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t0


def _decode_step_time(llm, prompts, steps: int) -> float:
    """Mean seconds of one decode step over `steps` steps, timed around the steps alone.

    The prefill step (every prompt gets its first token) runs untimed first. Timing the steps
    themselves, not the difference of two whole generations, keeps the figure positive when a
    quick run's steps are shorter than the noise of a generation."""
    from engine import SamplingParams

    engine = llm.engine
    sp = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    rids = [f"decode-timing-{i}" for i in range(len(prompts))]
    for rid, ids in zip(rids, prompts, strict=True):
        engine.add_request(rid, ids, sp)
    started: set[str] = set()  # requests with a first token: their prefill is done
    while len(started) < len(rids):
        started.update(out.request_id for out in engine.step() if out.token_ids)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    for rid in rids:
        engine.pop_finished(rid)
    return elapsed / steps


def measure_mode(path: str, dtype: str, quant: str | None, args) -> dict:
    """One engine in `dtype` with `quant`: bytes, prefill tokens/s, decode ms per step."""
    from engine import LLM

    # No prefix caching: every repeat must compute its prompts again.
    llm = LLM(
        path,
        dtype=dtype,
        quantization=quant,
        num_kv_blocks=args.kv_blocks,
        enable_prefix_caching=False,
    )
    vocab = llm.engine.model_config.vocab_size
    proj, total = projection_bytes(llm.engine.model)
    pre = _prompts(args.prefill_batch, args.prompt_len, vocab, 1)
    dec = _prompts(args.decode_batch, args.decode_prompt_len, vocab, 2)
    _timed(llm, pre[:1], 2)  # warm-up: kernels, allocator
    prefill, decode = [], []
    for _ in range(args.repeats):
        prefill.append(_timed(llm, pre, 1))
        decode.append(_decode_step_time(llm, dec, args.decode_steps))
    prefill.sort()
    decode.sort()
    med_prefill, med_decode = prefill[len(prefill) // 2], decode[len(decode) // 2]
    return {
        "dtype": dtype,
        "quantization": llm.engine.quantization,
        "projection_bytes": proj,
        "model_bytes": total,
        "prefill_tok_s": args.prefill_batch * args.prompt_len / med_prefill,
        "decode_step_ms": med_decode * 1e3,
    }


def run(args) -> dict:
    path = args.model_dir or str(cached_model("llama", args.preset, 0, CACHE_DIR))
    plan = [("bf16", "bfloat16", None), ("fp32", "float32", None)]
    plan += [(f"{q} ({args.dtype})", args.dtype, q) for q in QUANT_MODES]
    rows = {}
    for name, dtype, quant in plan:
        log(f"quant_speed: {name} ...")
        rows[name] = measure_mode(path, dtype, quant, args)
        log(f"  {rows[name]}")
    base = rows["bf16"]
    for row in rows.values():
        row["projection_bytes_vs_bf16"] = row["projection_bytes"] / base["projection_bytes"]
        row["prefill_speed_vs_bf16"] = row["prefill_tok_s"] / base["prefill_tok_s"]
        row["decode_step_vs_bf16"] = row["decode_step_ms"] / base["decode_step_ms"]
    return rows


def markdown(rows: dict) -> str:
    lines = [
        "| mode | layout | projection MB | vs bf16 | model MB | prefill tok/s | vs bf16 "
        "| decode ms/step | vs bf16 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['quantization']} | {r['projection_bytes'] / 2**20:.1f} | "
            f"{r['projection_bytes_vs_bf16']:.2f} | {r['model_bytes'] / 2**20:.1f} | "
            f"{r['prefill_tok_s']:.0f} | {r['prefill_speed_vs_bf16']:.2f} | "
            f"{r['decode_step_ms']:.2f} | {r['decode_step_vs_bf16']:.2f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, small batches")
    p.add_argument("--preset", default="small", choices=("tiny", "small"))
    p.add_argument("--dtype", default="bfloat16", help="activation dtype of quantized modes")
    p.add_argument("--prefill-batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--decode-prompt-len", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-blocks", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    p.add_argument("--model-dir", default=None, help="measure this checkpoint instead")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.prefill_batch, args.prompt_len = "tiny", 2, 64
        args.decode_batch, args.decode_steps, args.repeats = 2, 4, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    rows = run(args)
    table = markdown(rows)
    print(table)
    meta = {"machine": machine_info(args.threads), "command": " ".join(sys.argv)}
    write_json(
        args.json,
        {
            "meta": meta,
            "args": vars(args) | {"json": str(args.json)},
            "rows": rows,
            "markdown": table,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
