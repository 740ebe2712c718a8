"""Accuracy of each quantization mode against the fp32 engine, on trained (peaked) checkpoints.

    python benchmarks/quant_accuracy.py             # all four archs, tiny preset, 300 steps
    python benchmarks/quant_accuracy.py --quick     # llama only, fewer prompts: a smoke run

Random-weight checkpoints have near-flat next-token distributions, so any rounding flips
near-ties; the checkpoints here are `cached_model(arch, "tiny", train_steps=N)`, trained until
they memorise the embedded corpus (`tools/train_model.py`), so most positions are confident
the way a trained model's are, and the off-corpus prompts add uncertain ones.

Per arch and mode (bf16 = bfloat16 without quantization; fp8 = W8A8; fp8-weight-only; int8;
int8-w8a8, teacher-forced one token a step since its activations are quantized at decode rows;
the quantized modes with `--dtype` activations, float32 by default), against the fp32 engine:
- teacher-forced logits (`engine.scoring.teacher_forced_logits`) over fixed prompts: 5 corpus
  windows of 200 tokens and 3 off-corpus prompts of 64 (pseudo-words, shuffled corpus
  tokens): per-position cosine of the logits (mean, min), top-1 agreement, mean
  KL(fp32 || mode), and that KL over bf16's own KL;
- greedy agreement: 4 corpus prompts (24 tokens at 4 offsets) decoded 128 tokens
  (`ignore_eos`, temperature 0) with `LLM.generate`, the share of the 4 x 128 positions whose
  token equals the fp32 run's;
- the disaggregated pair (fp8 W8A8 prefill engine, KV copied, int8 decode engine: what
  `tandem serve --quantized` runs), greedy agreement only, via tests/kv_copy.py.
The bounds column checks the quantization issue's acceptance bounds (`BOUNDS`).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    CACHE_DIR,
    load_avg,
    log,
    machine_info,
    set_threads,
    write_json,
)

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
QUANT_MODES = ("fp8", "fp8-weight-only", "int8", "int8-w8a8")
# Modes whose arithmetic differs only at decode rows (1-3 a projection): their teacher-forced
# logits come one token a step, as batch-1 decode computes them.
DECODE_ROW_MODES = ("int8-w8a8",)
DISAGG = "fp8+int8"  # fp8 W8A8 prefill engine, int8 decode engine
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "quant_accuracy.json"
# The acceptance bounds, per architecture, for each mode against fp32.
BOUNDS = {
    "cos_mean": 0.999,  # logits cosine (mean over positions; the min is reported beside it)
    "top1": 0.99,  # teacher-forced top-1 agreement
    "kl_ratio": 4.0,  # KL(fp32 || mode) within 4x bf16's own KL(fp32 || bf16)
    "greedy": 0.97,  # greedy agreement over 128 tokens
}
EVAL_WINDOWS = (0, 300, 600, 900, 1200)  # corpus token offsets of the 200-token windows
GREEDY_OFFSETS = (0, 450, 900, 1350)  # corpus token offsets of the 24-token greedy prompts


def eval_prompts(tokenizer, quick: bool = False) -> dict[str, list[list[int]]]:
    """Teacher-forcing inputs: {"corpus": windows the model memorised, "off_corpus": prompts
    it never saw (pseudo-words of two seeds, the corpus's tokens shuffled)}."""
    from tools.tokenizer_corpus import synthetic_words
    from tools.train_model import corpus_token_ids

    ids = corpus_token_ids(tokenizer)
    windows = EVAL_WINDOWS[:2] if quick else EVAL_WINDOWS
    corpus = [ids[o : o + 200] for o in windows]
    off = []
    for seed in (1, 2):
        text = " ".join(synthetic_words(200, seed=seed))
        off.append(list(tokenizer(text, add_special_tokens=False)["input_ids"])[:64])
    shuffled = list(ids)
    random.Random(0).shuffle(shuffled)
    off.append(shuffled[:64])
    return {"corpus": corpus, "off_corpus": off[:1] if quick else off}


def greedy_prompts(
    tokenizer, off_corpus: list[list[int]], quick: bool = False
) -> dict[str, list[list[int]]]:
    """Greedy-decoding prompts: {"corpus": 24 tokens at each of `GREEDY_OFFSETS` (the bound's
    prompts), "off_corpus": the first 24 tokens of each off-corpus teacher-forcing prompt
    (reported, not bounded)}."""
    from tools.train_model import corpus_token_ids

    ids = corpus_token_ids(tokenizer)
    offsets = GREEDY_OFFSETS[:2] if quick else GREEDY_OFFSETS
    return {
        "corpus": [ids[o : o + 24] for o in offsets],
        "off_corpus": [p[:24] for p in off_corpus],
    }


def load(path: Path, dtype: str, quantization: str, **kw):
    from engine import LLM

    return LLM(str(path), dtype=dtype, quantization=quantization, num_kv_blocks=96, **kw)


def teacher_forced(llm, prompts: dict[str, list[list[int]]], rows: int = 0) -> dict[str, list]:
    from engine.scoring import teacher_forced_logits

    return {
        g: [teacher_forced_logits(llm.engine, p, rows_per_step=rows) for p in ps]
        for g, ps in prompts.items()
    }


def greedy(llm, prompts: dict[str, list[list[int]]], max_tokens: int) -> dict[str, list]:
    from engine import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return {g: [list(o.token_ids) for o in llm.generate(ps, sp)] for g, ps in prompts.items()}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions (over all sequences) where the two runs chose the same token."""
    pairs = [(x, y) for s, t in zip(a, b, strict=True) for x, y in zip(s, t, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def position_metrics(ref, got) -> dict:
    """Per-position cosine, top-1 match and KL(ref || got) of two [T, V] fp32 logit tensors."""
    import torch.nn.functional as F

    lp_ref, lp_got = F.log_softmax(ref, -1), F.log_softmax(got, -1)
    return {
        "cos": F.cosine_similarity(ref, got, dim=-1),
        "top1": (ref.argmax(-1) == got.argmax(-1)).float(),
        "kl": (lp_ref.exp() * (lp_ref - lp_got)).sum(-1).clamp_min(0.0),
        "max_prob": lp_ref.max(-1).values.exp(),
    }


def summarize_positions(ref: dict[str, list], got: dict[str, list]) -> dict:
    """Teacher-forced metrics over all positions, and per prompt group."""
    import torch

    per = {g: [position_metrics(r, x) for r, x in zip(ref[g], got[g], strict=True)] for g in ref}

    def stats(ms: list[dict]) -> dict:
        cat = {k: torch.cat([m[k] for m in ms]) for k in ("cos", "top1", "kl", "max_prob")}
        return {
            "positions": int(cat["cos"].numel()),
            "cos_mean": float(cat["cos"].mean()),
            "cos_min": float(cat["cos"].min()),
            "top1": float(cat["top1"].mean()),
            "kl": float(cat["kl"].mean()),
            "ref_mean_max_prob": float(cat["max_prob"].mean()),
        }

    out = stats([m for ms in per.values() for m in ms])
    out["by_group"] = {g: stats(ms) for g, ms in per.items()}
    return out


def disagg_greedy(path: Path, dtype: str, prompts: dict, max_tokens: int) -> dict:
    """Greedy outputs of an fp8 W8A8 prefill engine whose KV is copied into an int8 decode
    engine (tests/kv_copy.py, the in-process hand-off the e2e tests compare against)."""
    from engine import SamplingParams
    from engine.llm_engine import EngineConfig, LLMEngine
    from tests.kv_copy import disaggregated_greedy

    kw = dict(model=str(path), dtype=dtype, num_kv_blocks=96)
    pe = LLMEngine(EngineConfig(**kw, role="prefill", quantization="fp8"))
    de = LLMEngine(EngineConfig(**kw, role="decode", quantization="int8"))
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    flat = [p for ps in prompts.values() for p in ps]
    outs = iter(disaggregated_greedy(pe, de, flat, sp))
    return {g: [next(outs) for _ in ps] for g, ps in prompts.items()}


def mode_runs(qdtype: str) -> list[tuple[str, str, str]]:
    """(label, dtype, quantization) of every engine measured, the fp32 reference first."""
    return [("fp32", "float32", "none"), ("bf16", "bfloat16", "none")] + [
        (q, qdtype, q) for q in QUANT_MODES
    ]


def greedy_metrics(ref: dict, got: dict) -> dict:
    return {
        "greedy": agreement(ref["corpus"], got["corpus"]),
        "greedy_off_corpus": agreement(ref["off_corpus"], got["off_corpus"]),
    }


def measure_arch(path: Path, qdtype: str = "float32", quick: bool = False) -> dict:
    """{"modes": {label: metrics}} for one checkpoint: every mode against its fp32 run."""
    from engine.model_info import load_tokenizer

    tok = load_tokenizer(str(path))
    prompts = eval_prompts(tok, quick)
    gprompts = greedy_prompts(tok, prompts["off_corpus"], quick)
    max_tokens = 32 if quick else 128
    ref_logits = ref_tokens = None
    rows: dict[str, dict] = {}
    for label, dtype, quant in mode_runs(qdtype):
        llm = load(path, dtype, quant)
        rows_per_step = 1 if quant in DECODE_ROW_MODES else 0
        logits = teacher_forced(llm, prompts, rows_per_step)
        tokens = greedy(llm, gprompts, max_tokens)
        del llm
        if ref_logits is None:
            ref_logits, ref_tokens = logits, tokens
            continue
        rows[label] = {"dtype": dtype, "quantization": quant}
        rows[label].update(summarize_positions(ref_logits, logits))
        rows[label].update(greedy_metrics(ref_tokens, tokens))
    for row in rows.values():
        row["kl_ratio"] = row["kl"] / rows["bf16"]["kl"] if rows["bf16"]["kl"] > 0 else math.inf
    dis = disagg_greedy(path, qdtype, gprompts, max_tokens)
    rows[DISAGG] = {"dtype": qdtype, "quantization": "fp8 prefill, int8 decode"}
    rows[DISAGG].update(greedy_metrics(ref_tokens, dis))
    return {
        "greedy_tokens": max_tokens,
        "greedy_prompts": {g: len(ps) for g, ps in gprompts.items()},
        "modes": rows,
    }


def failed_bounds(row: dict) -> list[str]:
    """Names of the issue's bounds this row misses (only those it has a value for)."""
    fails = []
    if "cos_mean" in row and row["cos_mean"] < BOUNDS["cos_mean"]:
        fails.append("cos")
    if "top1" in row and row["top1"] < BOUNDS["top1"]:
        fails.append("top1")
    if "kl_ratio" in row and row["kl_ratio"] > BOUNDS["kl_ratio"]:
        fails.append("KL")
    if row["greedy"] < BOUNDS["greedy"]:
        fails.append("greedy")
    return fails


def _row_cells(row: dict) -> list[str]:
    def f(key: str, fmt: str, src: dict = row) -> str:
        return format(src[key], fmt) if key in src else "—"

    groups = row.get("by_group", {})
    split = "—"
    if groups:
        split = f"{f('top1', '.3f', groups['corpus'])} / {f('top1', '.3f', groups['off_corpus'])}"
    return [
        f("cos_mean", ".6f"),
        f("cos_min", ".5f"),
        f("top1", ".4f"),
        split,
        f("kl", ".2e"),
        f("kl_ratio", ".1f"),
        f("greedy", ".4f"),
        f("greedy_off_corpus", ".3f"),
    ]


def table(results: dict[str, dict]) -> str:
    """Markdown: one row per arch and mode, the issue's bounds checked in the last column."""
    cols = [
        "arch",
        "mode",
        "cos mean",
        "cos min",
        "top-1",
        "top-1 corpus / off",
        "KL(fp32‖mode)",
        "KL / KL_bf16",
        "greedy",
        "greedy off-corpus (info)",
        "issue bounds",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for arch, r in results.items():
        for label, row in r["modes"].items():
            fails = failed_bounds(row)
            verdict = "PASS" if not fails else "FAIL: " + ", ".join(fails)
            if label == "bf16":
                verdict = "(reference) " + verdict
            name = label if row["dtype"] == "float32" or label == "bf16" else f"{label} (bf16)"
            lines.append("| " + " | ".join([arch, name, *_row_cells(row), verdict]) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", nargs="+", default=None, choices=ARCHS, help="default: all")
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="activation dtype of the quantized modes",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: the tiny model's GEMMs are too small to share)",
    )
    ap.add_argument("--cache-dir", default=str(CACHE_DIR), help="where the checkpoints are made")
    ap.add_argument("--model-dir", default=None, help="measure this checkpoint (one arch)")
    ap.add_argument("--quick", action="store_true", help="llama only, fewer prompts and tokens")
    ap.add_argument("--out", "--json", dest="out", default=str(DEFAULT_JSON))
    args = ap.parse_args(argv)
    args.archs = args.archs or (["llama"] if args.quick or args.model_dir else list(ARCHS))
    if args.model_dir and len(args.archs) != 1:
        ap.error("--model-dir is one checkpoint: name its arch with --archs ARCH")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    from tools.make_model import cached_model

    info = machine_info(args.threads)
    isa = ", ".join(info["native_bf16_isa"]) or "no native bf16"
    log(
        f"machine: {info['cpu']} ({isa}), {args.threads} torch threads, load "
        f"{info['load_avg_1_5_15'][0]:.2f}"
    )
    results = {}
    for arch in args.archs:
        path = Path(args.model_dir) if args.model_dir else None
        path = path or cached_model(arch, "tiny", 0, args.cache_dir, train_steps=args.train_steps)
        log(f"{arch}: {path}")
        results[arch] = measure_arch(path, args.dtype, args.quick)
    print(table(results), flush=True)
    config = {
        "archs": args.archs,
        "preset": "tiny",
        "train_steps": None if args.model_dir else args.train_steps,
        "model_dir": args.model_dir,
        "quant_dtype": args.dtype,
        "quick": args.quick,
        "bounds": BOUNDS,
        "eval_windows": list(EVAL_WINDOWS),
        "greedy_offsets": list(GREEDY_OFFSETS),
    }
    out = {"benchmark": "quant_accuracy", "command": " ".join(sys.argv), "machine": info}
    write_json(
        args.out, {**out, "config": config, "results": results, "load_avg_after": load_avg()}
    )
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
