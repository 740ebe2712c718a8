"""Roofline: how close tandem's decode and prefill steps come to this machine's limits.

Measured in one run, on the same threads:

- read bandwidth: best of repeated `x.sum()` over a large float32 tensor (`--bw-mib`, default
  1 GiB) — a pure streaming read — measured at the start and again after every decode phase;
  the best over the whole run is the bound's bandwidth (the most demanding bound);
- GEMM peak: best of repeated square matmuls (`--gemm-n`) in bfloat16 and in float32, measured
  at the start and after each dtype's phases; the peak quoted is the best of all (the fastest
  GEMM torch offers on this CPU);
- decode: the median wall time of `LLMEngine.step()` in steady-state decode for a batch of
  1 and of 16 sequences with a `--context`-token prompt (scheduling, metadata, the model, and
  sampling: the whole step). Bound = (weight bytes + KV bytes read) / read bandwidth, where
  weight bytes are every parameter read once per step except the embedding table (only the
  batch's rows are gathered) and KV bytes = context * 2 * layers * kv_heads * head_dim *
  dtype bytes * batch, at the mean context of the timed steps;
- prefill: one `--prefill-tokens` prompt in one step (median of repetitions); FLOPs =
  2 * (decoder-layer params) * tokens + 2 * lm_head params (logits for the last token only)
  + causal attention 2 * layers * heads * head_dim * tokens^2 (QK^T and PV, half the square).

Fractions: decode = bound / measured (1.0 means at the bandwidth bound), prefill = achieved
FLOP/s / GEMM peak. The engine's dtype (`--dtype`, default bfloat16) is the benchmark; `--also`
adds other dtypes for reference (float32 by default).
Usage: `python benchmarks/roofline.py [--quick] [--json PATH]`.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
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
    summarize,
    time_calls,
    write_json,
)
from tools.make_model import cached_model  # noqa: E402

GOAL_DECODE_B1 = 0.60
_TRIAL = itertools.count()


def measure_read_bandwidth(mib: int, reps: int) -> dict:
    import torch

    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    nbytes = x.numel() * 4
    samples = time_calls(x.sum, reps, warmup=1)
    return {
        "method": "float32 tensor.sum()",
        "bytes": nbytes,
        "seconds": summarize(samples),
        "best_bytes_per_s": nbytes / min(samples),
        "median_bytes_per_s": nbytes / statistics.median(samples),
    }


def measure_gemm_peak(n: int, reps: int) -> dict:
    import torch

    out = {}
    for name, dt in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
        samples = time_calls(lambda a=a, b=b: a @ b, reps, warmup=1)
        out[name] = {
            "n": n,
            "seconds": summarize(samples),
            "best_flops": 2 * n**3 / min(samples),
        }
    out["peak_flops"] = max(v["best_flops"] for v in out.values())
    out["peak_dtype"] = max(("bfloat16", "float32"), key=lambda k: out[k]["best_flops"])
    return out


def weight_bytes_per_step(model, batch: int) -> int:
    """Bytes of parameters a decode step reads: all but the embedding table, plus its rows
    (int8 weights and their scales, which are buffers, included)."""
    emb = model.model.embed_tokens.weight
    total = 0
    seen = set()
    tensors = itertools.chain(
        model.named_parameters(remove_duplicate=False),
        ((n, b) for n, b in model.named_buffers() if n.endswith(("qweight", "wscale"))),
    )
    for _, p in tensors:
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p is emb and model.lm_head.weight is not emb:
            total += batch * emb.shape[1] * emb.element_size()
        else:
            total += p.numel() * p.element_size()  # a tied table is read whole by lm_head
    return total


def kv_bytes_per_token(engine) -> int:
    spec = engine.kv_spec
    import torch

    el = torch.empty((), dtype=spec.cache_dtype).element_size()
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * el


def _engine(model_dir: Path, dtype: str, max_tokens_per_step: int, quantization: str):
    from engine.llm_engine import EngineConfig, LLMEngine

    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype=dtype,
            enable_prefix_caching=False,
            max_num_batched_tokens=max_tokens_per_step,
            kv_cache_memory_gb=0.5,
            quantization=quantization,
        )
    )


def measure_decode(
    engine, batch: int, context: int, steps: int, warmup: int, seed: int, bandwidth: float
) -> dict:
    import torch

    from engine.protocol import SamplingParams

    g = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    trial = next(_TRIAL)
    rids = [f"decode-b{batch}-t{trial}-{i}" for i in range(batch)]
    # Slack: sequences prefilled in an early chunk decode while the later ones prefill.
    sp = SamplingParams(max_tokens=warmup + steps + 64 + context, temperature=0, ignore_eos=True)
    for rid in rids:
        engine.add_request(rid, torch.randint(4, vocab, (context,), generator=g).tolist(), sp)
    while any(engine.seqs[r].num_output_tokens == 0 for r in rids):
        engine.step()  # prefill
    for _ in range(warmup):
        engine.step()
    tokens0 = sum(engine.seqs[r].num_tokens for r in rids)  # KV the first timed step reads
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = engine.step()
        samples.append(time.perf_counter() - t0)
        assert len(outs) == batch, f"a decode step produced {len(outs)} tokens, not {batch}"
    for rid in rids:
        engine.abort(rid)
    # Step i reads the KV of tokens0 + i * batch tokens (each new token's own KV included).
    mean_ctx = (tokens0 + batch * (steps - 1) / 2) / batch
    w_bytes = weight_bytes_per_step(engine.model, batch)
    kv_bytes = mean_ctx * kv_bytes_per_token(engine) * batch
    med = statistics.median(samples)
    return apply_bound(
        {
            "batch": batch,
            "context_tokens_mean": mean_ctx,
            "step_seconds": summarize(samples),
            "weight_bytes": w_bytes,
            "kv_bytes": kv_bytes,
            "achieved_bytes_per_s": (w_bytes + kv_bytes) / med,
            "output_tokens_per_s": batch / med,
        },
        bandwidth,
    )


def apply_bound(d: dict, bandwidth: float) -> dict:
    """(Re)compute a decode result's bound and fractions for a read bandwidth."""
    bound = (d["weight_bytes"] + d["kv_bytes"]) / bandwidth
    d["bound_seconds"] = bound
    d["fraction_of_bound"] = bound / d["step_seconds"]["median"]
    d["fraction_of_bound_best_step"] = bound / d["step_seconds"]["min"]
    return d


def prefill_flops(engine, tokens: int) -> float:
    mc = engine.model_config
    model = engine.model
    layer_params = sum(p.numel() for p in model.model.layers.parameters()) + sum(
        b.numel() for n, b in model.model.layers.named_buffers() if n.endswith("qweight")
    )
    lm_head = model.lm_head.weight.numel()
    attn = 2 * mc.num_layers * mc.num_heads * mc.head_dim * tokens * tokens
    return 2 * layer_params * tokens + 2 * lm_head + attn


def measure_prefill(engine, tokens: int, reps: int, seed: int, peak: dict) -> dict:
    import torch

    from engine.protocol import SamplingParams

    g = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    counter = iter(range(10**9))

    def one() -> None:
        rid = f"prefill-{next(counter)}"
        engine.add_request(rid, torch.randint(4, vocab, (tokens,), generator=g).tolist(), sp)
        outs = engine.step()
        assert len(outs) == 1 and outs[0].finish_reason == "length", "prefill took >1 step"
        engine.pop_finished(rid)

    samples = time_calls(one, reps, warmup=1)
    flops = prefill_flops(engine, tokens)
    med = statistics.median(samples)
    return apply_peak(
        {
            "tokens": tokens,
            "step_seconds": summarize(samples),
            "flops": flops,
            "achieved_flops": flops / med,
            "prompt_tokens_per_s": tokens / med,
        },
        peak,
    )


def apply_peak(p: dict, peak: dict) -> dict:
    a = p["achieved_flops"]
    p["fraction_of_peak"] = a / peak["peak_flops"]
    p["fraction_of_bf16_matmul_peak"] = a / peak["bfloat16"]["best_flops"]
    p["fraction_of_fp32_matmul_peak"] = a / peak["float32"]["best_flops"]
    return p


def merge_peaks(a: dict, b: dict) -> dict:
    """The better of two GEMM peak measurements, per dtype."""
    out = {
        k: (a[k] if a[k]["best_flops"] >= b[k]["best_flops"] else b[k])
        for k in ("bfloat16", "float32")
    }
    out["peak_flops"] = max(v["best_flops"] for v in out.values())
    out["peak_dtype"] = max(("bfloat16", "float32"), key=lambda k: out[k]["best_flops"])
    return out


class BandwidthProbe:
    """Read bandwidth, re-measured between phases: the machine is shared, so a single early
    measurement can land in a busy moment. The bound uses the best read seen in the whole run
    (the fastest the memory has been shown to go: the most demanding bound)."""

    def __init__(self, mib: int, reps: int):
        self.mib, self.reps, self.samples = mib, reps, []

    def measure(self) -> dict:
        r = measure_read_bandwidth(self.mib, self.reps)
        self.samples.append(r["best_bytes_per_s"])
        return r

    @property
    def best(self) -> float:
        return max(self.samples)


def run_dtype(model_dir, dtype, args, probe: BandwidthProbe, peak) -> dict:
    log(f"[{dtype}] loading engine")
    engine = _engine(model_dir, dtype, max(args.prefill_tokens, 512), args.quantization)
    out = {"decode": {}, "prefill": None}
    for b in args.batches:
        log(f"[{dtype}] decode batch {b}, context {args.context}: {args.steps} timed steps")
        # Trials: the box is shared, so a phase can land in a busy moment; the bound uses the
        # best bandwidth seen, so the step uses the best trial's median (all are recorded).
        trials = [
            measure_decode(engine, b, args.context, args.steps, args.warmup, args.seed, probe.best)
            for _ in range(args.trials)
        ]
        d = min(trials, key=lambda t: t["step_seconds"]["median"])
        d["trial_medians_seconds"] = [t["step_seconds"]["median"] for t in trials]
        out["decode"][str(b)] = d
        probe.measure()
        log(
            f"  step {d['step_seconds']['median'] * 1e3:.2f} ms (min "
            f"{d['step_seconds']['min'] * 1e3:.2f}), bound {d['bound_seconds'] * 1e3:.2f} ms, "
            f"fraction {d['fraction_of_bound']:.2f}"
        )
    log(f"[{dtype}] prefill {args.prefill_tokens} tokens: {args.prefill_reps} reps")
    p = measure_prefill(engine, args.prefill_tokens, args.prefill_reps, args.seed, peak)
    out["prefill"] = p
    log(
        f"  step {p['step_seconds']['median'] * 1e3:.1f} ms, {p['achieved_flops'] / 1e9:.1f} "
        f"GFLOP/s, fraction of peak {p['fraction_of_peak']:.2f}"
    )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run (tiny model)")
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--preset", default=None, help="default small; tiny with --quick")
    ap.add_argument("--model-dir", type=str, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--also", nargs="*", default=None, help="reference dtypes (default float32)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=None, help="decode prompt tokens (256)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps (64)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument(
        "--quantization",
        default="none",
        choices=["none", "int8"],
        help="weight-only quantization of the engine (the bound counts its bytes)",
    )
    ap.add_argument(
        "--trials",
        type=int,
        default=3,
        help="decode phases per batch size; the best median counts (default 3)",
    )
    ap.add_argument("--prefill-tokens", type=int, default=None, help="(512)")
    ap.add_argument("--prefill-reps", type=int, default=None, help="(7)")
    ap.add_argument("--bw-mib", type=int, default=None, help="bandwidth tensor size (1024)")
    ap.add_argument("--gemm-n", type=int, default=None, help="matmul size (2048)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    _fill_defaults(args)
    return args


def _fill_defaults(args: argparse.Namespace) -> None:
    """Replace unset sizes with the --quick (tiny model) or full-run defaults."""
    q = args.quick
    args.preset = args.preset or ("tiny" if q else "small")
    args.context = args.context or (64 if q else 256)
    args.steps = args.steps or (8 if q else 64)
    args.prefill_tokens = args.prefill_tokens or (128 if q else 512)
    args.prefill_reps = args.prefill_reps or (2 if q else 7)
    args.bw_mib = args.bw_mib or (128 if q else 1024)
    args.gemm_n = args.gemm_n or (512 if q else 2048)
    args.also = args.also if args.also is not None else ([] if q else ["float32"])


def measure_limits(args) -> tuple[BandwidthProbe, dict, dict]:
    """The machine's first read bandwidth and GEMM peak measurements (re-measured later)."""
    q = args.quick
    log(f"measuring read bandwidth ({args.bw_mib} MiB float32 sum)")
    probe = BandwidthProbe(args.bw_mib, 5 if q else 10)
    bw = probe.measure()
    log(
        f"  {bw['best_bytes_per_s'] / 1e9:.1f} GB/s best, "
        f"{bw['median_bytes_per_s'] / 1e9:.1f} GB/s median"
    )
    log(f"measuring GEMM peak ({args.gemm_n}^3 matmul)")
    peak = measure_gemm_peak(args.gemm_n, 3 if q else 8)
    log(
        f"  bf16 {peak['bfloat16']['best_flops'] / 1e9:.1f} GFLOP/s, fp32 "
        f"{peak['float32']['best_flops'] / 1e9:.1f} GFLOP/s"
    )
    return probe, bw, peak


def measure_dtypes(
    model_dir: Path, args, probe: BandwidthProbe, bw: dict, peak: dict
) -> tuple[dict, dict]:
    """Decode and prefill per dtype, then every fraction against the best limits of the run.
    Returns (results per dtype, the merged GEMM peak); updates `bw` with the best probe."""
    results = {}
    for dtype in [args.dtype, *[d for d in args.also if d != args.dtype]]:
        results[dtype] = run_dtype(model_dir, dtype, args, probe, peak)
        # Shared box: re-measure the peak after each dtype and keep the better one.
        peak = merge_peaks(peak, measure_gemm_peak(args.gemm_n, 3 if args.quick else 5))
    for r in results.values():
        apply_peak(r["prefill"], peak)
    # Every decode fraction against the best bandwidth seen in the run.
    bw["best_bytes_per_s"] = probe.best
    bw["all_probes_best_bytes_per_s"] = probe.samples
    for r in results.values():
        for d in r["decode"].values():
            apply_bound(d, probe.best)
    return results, peak


def build_result(args, model_dir: Path, info: dict, bw: dict, peak: dict, results: dict) -> dict:
    """The JSON report: config, the machine's limits, every phase and the decode goal."""
    b1 = results[args.dtype]["decode"].get("1")
    return {
        "benchmark": "roofline",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": info,
        "load_avg_after": load_avg(),
        "config": {
            "model": model_dir.name,
            "dtype": args.dtype,
            "batches": args.batches,
            "context": args.context,
            "steps": args.steps,
            "prefill_tokens": args.prefill_tokens,
            "bw_mib": args.bw_mib,
            "gemm_n": args.gemm_n,
            "quantization": args.quantization,
        },
        "read_bandwidth": bw,
        "gemm_peak": peak,
        "results": results,
        "decode_b1_fraction": b1["fraction_of_bound"] if b1 else None,
        "goal_decode_b1_fraction": GOAL_DECODE_B1,
        "meets_goal": bool(b1 and b1["fraction_of_bound"] >= GOAL_DECODE_B1),
    }


def print_summary(result: dict) -> None:
    """The limits line, the measured-vs-bound table and the main dtype's two fractions."""
    bw, peak, results = result["read_bandwidth"], result["gemm_peak"], result["results"]
    dtype_main = result["config"]["dtype"]
    main_r = results[dtype_main]
    b1 = main_r["decode"].get("1")
    print()
    print(
        f"read bandwidth {bw['best_bytes_per_s'] / 1e9:.1f} GB/s; GEMM peak "
        f"{peak['peak_flops'] / 1e9:.1f} GFLOP/s ({peak['peak_dtype']}; bf16 "
        f"{peak['bfloat16']['best_flops'] / 1e9:.1f}, fp32 "
        f"{peak['float32']['best_flops'] / 1e9:.1f})"
    )
    print(f"{'dtype':<10}{'phase':<16}{'measured':>12}{'bound':>12}{'fraction':>10}")
    for dtype, r in results.items():
        for b, d in r["decode"].items():
            print(
                f"{dtype:<10}{f'decode b={b}':<16}{d['step_seconds']['median'] * 1e3:>10.2f}ms"
                f"{d['bound_seconds'] * 1e3:>10.2f}ms{d['fraction_of_bound']:>10.2f}"
            )
        p = r["prefill"]
        label = f"prefill {p['tokens']}"
        print(
            f"{dtype:<10}{label:<16}"
            f"{p['achieved_flops'] / 1e9:>6.1f}GFLOP/s{peak['peak_flops'] / 1e9:>6.1f}GFLOP/s"
            f"{p['fraction_of_peak']:>10.2f}"
        )
    if b1:
        print(
            f"decode batch 1 ({dtype_main}): {b1['fraction_of_bound']:.2f} of the bandwidth "
            f"bound (goal >= {GOAL_DECODE_B1})"
        )
    print(
        f"prefill {result['config']['prefill_tokens']} ({dtype_main}): "
        f"{main_r['prefill']['fraction_of_peak']:.2f} of the GEMM peak"
    )
    print(f"load average now: {result['load_avg_after']:.2f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    model_dir = (
        Path(args.model_dir)
        if args.model_dir
        else cached_model(args.arch, args.preset, cache_dir=CACHE_DIR)
    )
    info = machine_info(args.threads)
    log(
        f"roofline: model {model_dir.name}, {args.threads} threads, load "
        f"{info['load_avg_1_5_15'][0]:.2f}"
    )
    probe, bw, peak = measure_limits(args)
    results, peak = measure_dtypes(model_dir, args, probe, bw, peak)
    result = build_result(args, model_dir, info, bw, peak, results)
    print_summary(result)
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
