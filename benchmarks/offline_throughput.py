"""Offline throughput: tandem's `LLM.generate` against Hugging Face transformers `generate`.

One run measures three ways of serving the same requests with the same weights (the
`make_model` checkpoint, loaded by both), greedy, every request running to its requested
length (EOS ignored):

1. tandem: all requests handed to `LLM.generate` at once (continuous batching, paged KV).
2. transformers, static batches: requests in arrival order, `--hf-batch-size` at a time,
   left-padded with an attention mask, `max_new_tokens` = the longest requested output of the
   batch (what a static batch costs). Only each request's requested tokens count as output.
3. transformers, one request at a time: `generate` per request with its own length, over a
   seeded random subset of `--hf-single-requests` requests (all of them takes long on a CPU).

Each prints output tokens/s; the ratios tandem / (2) and tandem / (3) are the result.
Usage: `python benchmarks/offline_throughput.py [--quick] [--json PATH]`.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
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
from tools.make_model import cached_model  # noqa: E402

GOAL_VS_BATCHED = 2.0
GOAL_VS_SINGLE = 8.0


def make_requests(
    n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int
) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request; lengths uniform in the inclusive ranges.
    Ids avoid 0..3 (pad/bos/eos/turn specials)."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        olen = rng.randint(*output_range)
        reqs.append(([rng.randrange(4, vocab) for _ in range(plen)], olen))
    return reqs


def run_tandem(model_dir: Path, reqs, dtype: str, max_num_batched_tokens: int) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(
        str(model_dir),
        dtype=dtype,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=False,
    )
    # Warm-up (first-call library initialisation is not throughput).
    llm.generate([reqs[0][0][:8]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    got = [len(o.token_ids) for o in outs]
    want = [o for _, o in reqs]
    if got != want:
        raise RuntimeError(f"tandem produced wrong output lengths: {got} != {want}")
    n_out = sum(got)
    return {
        "seconds": elapsed,
        "output_tokens": n_out,
        "output_tokens_per_s": n_out / elapsed,
        "num_steps": llm.engine.num_steps,
        "outputs": [o.token_ids for o in outs],
    }


def _hf_model(model_dir: Path, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    # ignore_eos: generation never stops early (min_new_tokens would bias the logits instead).
    model.generation_config.eos_token_id = None
    return model


def _hf_generate(model, prompts: list[list[int]], max_new_tokens: int):
    """Left-padded greedy batch; returns the generated ids [batch, max_new_tokens]."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            min_new_tokens=None,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, width:]


def run_hf_batched(model, reqs, batch_size: int, max_batches: int | None) -> dict:
    batches = [reqs[i : i + batch_size] for i in range(0, len(reqs), batch_size)]
    if max_batches is not None:
        batches = batches[:max_batches]
    useful = generated = 0
    t0 = time.perf_counter()
    for b, batch in enumerate(batches):
        longest = max(o for _, o in batch)
        out = _hf_generate(model, [p for p, _ in batch], longest)
        if out.shape[1] != longest:
            raise RuntimeError(f"HF batch produced {out.shape[1]} tokens, wanted {longest}")
        useful += sum(o for _, o in batch)
        generated += longest * len(batch)
        log(
            f"  hf batched: batch {b + 1}/{len(batches)} ({len(batch)} reqs, {longest} steps) "
            f"{time.perf_counter() - t0:.1f}s"
        )
    elapsed = time.perf_counter() - t0
    return {
        "seconds": elapsed,
        "num_requests": sum(len(b) for b in batches),
        "batch_size": batch_size,
        "output_tokens": useful,
        "generated_tokens_incl_padding_steps": generated,
        "output_tokens_per_s": useful / elapsed,
    }


def run_hf_single(model, reqs, subset: list[int]) -> dict:
    useful = 0
    outputs = {}
    t0 = time.perf_counter()
    for k, i in enumerate(subset):
        prompt, olen = reqs[i]
        out = _hf_generate(model, [prompt], olen)
        outputs[i] = out[0].tolist()
        useful += olen
        log(
            f"  hf single: request {k + 1}/{len(subset)} ({len(prompt)} in, {olen} out) "
            f"{time.perf_counter() - t0:.1f}s"
        )
    elapsed = time.perf_counter() - t0
    return {
        "seconds": elapsed,
        "num_requests": len(subset),
        "request_indices": subset,
        "output_tokens": useful,
        "output_tokens_per_s": useful / elapsed,
        "outputs": outputs,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run (tiny model)")
    ap.add_argument("--json", type=str, default=None, help="write results here")
    ap.add_argument("--arch", default="llama")
    ap.add_argument(
        "--preset", default=None, help="make_model preset (default small; tiny with --quick)"
    )
    ap.add_argument("--model-dir", type=str, default=None, help="use this checkpoint instead")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    ap.add_argument("--hf-batch-size", type=int, default=None)
    ap.add_argument(
        "--hf-max-batches",
        type=int,
        default=None,
        help="time only the first N static batches (default: all)",
    )
    ap.add_argument(
        "--hf-single-requests",
        type=int,
        default=None,
        help="size of the random subset run one at a time",
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    _fill_defaults(args)
    return args


def _fill_defaults(args: argparse.Namespace) -> None:
    """Replace unset sizes with the --quick (tiny model) or full-run defaults."""
    q = args.quick
    args.preset = args.preset or ("tiny" if q else "small")
    args.num_requests = args.num_requests or (8 if q else 64)
    args.prompt_len = tuple(args.prompt_len or ((8, 48) if q else (32, 256)))
    args.output_len = tuple(args.output_len or ((4, 16) if q else (16, 192)))
    args.hf_batch_size = args.hf_batch_size or (4 if q else 16)
    args.hf_single_requests = min(args.num_requests, args.hf_single_requests or (2 if q else 16))


def measure(model_dir: Path, reqs, subset: list[int], args) -> tuple[dict, dict, dict]:
    """The three timed phases, in order: tandem, HF static batches, HF one at a time."""
    log("[1/3] tandem LLM.generate (all requests at once)")
    tandem = run_tandem(model_dir, reqs, args.dtype, args.max_num_batched_tokens)
    log(
        f"  tandem: {tandem['output_tokens']} tokens in {tandem['seconds']:.2f}s = "
        f"{tandem['output_tokens_per_s']:.1f} tok/s ({tandem['num_steps']} steps)"
    )

    hf = _hf_model(model_dir, args.dtype)
    _hf_generate(hf, [reqs[0][0][:8]], 2)  # warm-up
    log(f"[2/3] transformers generate, static padded batches of {args.hf_batch_size}")
    batched = run_hf_batched(hf, reqs, args.hf_batch_size, args.hf_max_batches)
    log(
        f"  hf batched: {batched['output_tokens']} useful tokens in {batched['seconds']:.2f}s = "
        f"{batched['output_tokens_per_s']:.1f} tok/s"
    )
    log(
        f"[3/3] transformers generate, one request at a time ({len(subset)} of {len(reqs)} "
        f"requests, seeded random subset)"
    )
    single = run_hf_single(hf, reqs, subset)
    log(
        f"  hf single: {single['output_tokens']} tokens in {single['seconds']:.2f}s = "
        f"{single['output_tokens_per_s']:.1f} tok/s"
    )
    return tandem, batched, single


def build_result(
    args,
    model_dir: Path,
    info: dict,
    reqs,
    subset: list[int],
    tandem: dict,
    batched: dict,
    single: dict,
) -> dict:
    """The JSON report: config, the three measurements, their ratios and the goals."""
    # Informational: in bf16, tie-breaks differ between kernels, so greedy paths may part.
    same = sum(tandem["outputs"][i] == single["outputs"][i] for i in subset)
    vs_batched = tandem["output_tokens_per_s"] / batched["output_tokens_per_s"]
    vs_single = tandem["output_tokens_per_s"] / single["output_tokens_per_s"]
    return {
        "benchmark": "offline_throughput",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": info,
        "load_avg_after": load_avg(),
        "config": {
            "model": model_dir.name,
            "arch": args.arch,
            "preset": args.preset,
            "dtype": args.dtype,
            "num_requests": args.num_requests,
            "prompt_len": list(args.prompt_len),
            "output_len": list(args.output_len),
            "seed": args.seed,
            "hf_batch_size": args.hf_batch_size,
            "hf_single_requests": args.hf_single_requests,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "total_prompt_tokens": sum(len(p) for p, _ in reqs),
            "total_output_tokens": sum(o for _, o in reqs),
        },
        "tandem": {k: v for k, v in tandem.items() if k != "outputs"},
        "hf_batched": batched,
        "hf_single": {k: v for k, v in single.items() if k != "outputs"},
        "greedy_outputs_equal_hf_single": f"{same}/{len(subset)}",
        "ratio_vs_hf_batched": vs_batched,
        "ratio_vs_hf_single": vs_single,
        "goal_vs_hf_batched": GOAL_VS_BATCHED,
        "goal_vs_hf_single": GOAL_VS_SINGLE,
        "meets_goals": vs_batched >= GOAL_VS_BATCHED and vs_single >= GOAL_VS_SINGLE,
    }


def print_summary(result: dict) -> None:
    """The tok/s table, the ratios against the goals and the greedy-agreement count."""
    hf_bs = result["config"]["hf_batch_size"]
    n_single = result["config"]["hf_single_requests"]
    print()
    print(f"{'system':<40}{'output tok/s':>14}")
    print(f"{'tandem (continuous batching)':<40}{result['tandem']['output_tokens_per_s']:>14.1f}")
    print(
        f"{f'HF generate, padded batches of {hf_bs}':<40}"
        f"{result['hf_batched']['output_tokens_per_s']:>14.1f}"
    )
    print(
        f"{f'HF generate, one at a time ({n_single} reqs)':<40}"
        f"{result['hf_single']['output_tokens_per_s']:>14.1f}"
    )
    print(
        f"ratio vs padded batches: {result['ratio_vs_hf_batched']:.2f}x "
        f"(goal >= {GOAL_VS_BATCHED}x)"
    )
    print(
        f"ratio vs one at a time:  {result['ratio_vs_hf_single']:.2f}x (goal >= {GOAL_VS_SINGLE}x)"
    )
    print(
        f"greedy outputs equal to HF one-at-a-time: {result['greedy_outputs_equal_hf_single']} "
        f"(bf16 kernels may break ties differently)"
    )
    print(f"load average now: {result['load_avg_after']:.2f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    n, prange, orange = args.num_requests, args.prompt_len, args.output_len

    set_threads(args.threads)
    import torch

    torch.manual_seed(args.seed)
    model_dir = (
        Path(args.model_dir)
        if args.model_dir
        else cached_model(args.arch, args.preset, cache_dir=CACHE_DIR)
    )
    from engine.config import ModelConfig

    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    reqs = make_requests(n, prange, orange, vocab, args.seed)
    subset = sorted(random.Random(args.seed + 1).sample(range(n), args.hf_single_requests))
    info = machine_info(args.threads)
    log(
        f"offline throughput: {n} requests, prompts {prange[0]}-{prange[1]}, outputs "
        f"{orange[0]}-{orange[1]} (ignore_eos, greedy), model {model_dir.name}, {args.dtype}, "
        f"{args.threads} threads, load {info['load_avg_1_5_15'][0]:.2f}"
    )

    tandem, batched, single = measure(model_dir, reqs, subset, args)
    result = build_result(args, model_dir, info, reqs, subset, tandem, batched, single)
    print_summary(result)
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
