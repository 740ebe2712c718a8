"""CPU kernels against the torch paths they replace, measured in the same run.

- bf16 GEMM (`engine.kernels.linear`) on the `small` model's weight shapes, at the row
  counts a step meets, against torch's own bf16 GEMM (oneDNN; emulated on CPUs without
  AVX512-BF16/AMX) and against oneDNN fp32 on widened copies (what the engine uses beyond
  `TILED_MAX_ROWS`). The crossover is where `engine.models.linear.TILED_MAX_ROWS` comes from.
- the same kernels on int8 weights with per-channel scales (weight-only quantization), against
  the bf16 kernel: half the bytes, so up to 2x where the product is bandwidth-bound.
- paged decode attention (`engine.kernels.paged_decode`) against the torch reference decode
  (`TorchAttentionBackend._decode_cpu_gather`: gather through the block table, two fp32
  batched matmuls) for a batch of sequences over a shuffled block-major cache, with the
  K/V bytes read per call over the measured single-stream read bandwidth as the bound.

Usage: `python benchmarks/cpu_kernels.py [--threads N] [--json PATH] [--quick]`.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import load_avg, log, machine_info, set_threads, write_json  # noqa: E402


def best_time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_gemm(ops, rows: list[int], reps: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from engine.models.linear import widen
    from engine.quantization import quantize_int8

    out = []
    # (name, N, K) of the small preset: lm_head, gate_up, down, qkv.
    for name, n, k in (
        ("lm_head", 8192, 512),
        ("gate_up", 3072, 512),
        ("down", 512, 1536),
        ("qkv", 1024, 512),
    ):
        w = torch.randn(n, k, dtype=torch.float32).to(torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, dtype=torch.float32).to(torch.bfloat16)
            r = {"weight": name, "n": n, "k": k, "rows": m}
            r["torch_bf16_s"] = best_time(lambda x=x, w=w: F.linear(x, w), reps)
            r["widened_fp32_s"] = best_time(
                lambda x=x, w=w: F.linear(widen(x), widen(w)).to(torch.bfloat16), reps
            )
            if m <= 3 and ops.gemv is not None:
                r["gemv_s"] = best_time(lambda x=x, w=w: ops.gemv(x, w, None, None), reps)
            r["tiled_s"] = best_time(lambda x=x, w=w: ops.tiled_linear(x, w, None, None), reps)
            qw, qs = quantize_int8(w)
            if m <= 3 and ops.gemv is not None:
                r["int8_gemv_s"] = best_time(lambda x=x, q=qw, s=qs: ops.gemv(x, q, s, None), reps)
            r["int8_tiled_s"] = best_time(
                lambda x=x, q=qw, s=qs: ops.tiled_linear(x, q, s, None), reps
            )
            int8 = min(r.get("int8_gemv_s", float("inf")), r["int8_tiled_s"])
            r["int8_speedup_vs_bf16_kernel"] = (
                min(r.get("gemv_s", float("inf")), r["tiled_s"]) / int8
            )
            kernel = min(r.get("gemv_s", float("inf")), r["tiled_s"])
            r["gflops_best_kernel"] = 2 * m * n * k / kernel / 1e9
            r["speedup_vs_torch_bf16"] = r["torch_bf16_s"] / kernel
            r["speedup_vs_widened_fp32"] = r["widened_fp32_s"] / kernel
            log(
                f"  {name:8s} rows {m:4d}: kernel {kernel * 1e3:7.3f} ms "
                f"({r['gflops_best_kernel']:5.1f} GFLOP/s)  torch bf16 "
                f"{r['torch_bf16_s'] * 1e3:7.3f} ms ({r['speedup_vs_torch_bf16']:4.1f}x)  "
                f"widened fp32 {r['widened_fp32_s'] * 1e3:7.3f} ms "
                f"({r['speedup_vs_widened_fp32']:4.2f}x)  int8 {int8 * 1e3:7.3f} ms "
                f"({r['int8_speedup_vs_bf16_kernel']:4.2f}x the bf16 kernel)"
            )
            out.append(r)
    return out


def bench_attention(ops, cases: list[tuple[int, int]], reps: int, bandwidth: float) -> list[dict]:
    import torch

    from engine.attention.torch_backend import DecodePlan, TorchAttentionBackend
    from engine.kv_cache import KVCache, KVCacheSpec

    out = []
    layers, kvh, heads, d, bs = 8, 4, 8, 64, 16  # the small preset
    for dtype in (torch.bfloat16, torch.float32):
        for batch, ctx in cases:
            nb = batch * (-(-ctx // bs))
            spec = KVCacheSpec(
                model="bench",
                num_layers=layers,
                num_kv_heads=kvh,
                head_dim=d,
                block_size=bs,
                dtype=dtype,
            )
            cache = KVCache(spec, nb + 1)
            cache.data.normal_()
            tables = (torch.randperm(nb) + 1).view(batch, -1)
            lens = torch.full((batch,), ctx, dtype=torch.int64)
            q = torch.randn(batch, heads, d, dtype=torch.float32).to(dtype)
            plan = DecodePlan(
                rows=None,
                tables=tables,
                ctx=ctx,
                mask=torch.ones(batch, 1, 1, tables.shape[1] * bs, dtype=torch.bool),
                lens=lens,
            )
            ref = TorchAttentionBackend(d**-0.5, cpu_kernel=False)
            k, v, _, _ = cache.layer_views(3)
            t_ref = best_time(functools.partial(ref._decode_cpu_gather, 3, q, cache, plan), reps)
            t_ker = best_time(
                functools.partial(
                    ops.paged_decode, q.float(), k, v, None, None, tables, lens, 0.125, 0
                ),
                reps,
            )
            kv_bytes = 2 * batch * ctx * kvh * d * cache.data.element_size()
            r = {
                "dtype": str(dtype).removeprefix("torch."),
                "batch": batch,
                "context": ctx,
                "reference_s": t_ref,
                "kernel_s": t_ker,
                "speedup": t_ref / t_ker,
                "kv_bytes": kv_bytes,
                "kernel_fraction_of_bandwidth": kv_bytes / t_ker / bandwidth,
            }
            log(
                f"  {r['dtype']:8s} batch {batch:3d} x {ctx:5d}: kernel {t_ker * 1e3:6.2f} ms, "
                f"gather reference {t_ref * 1e3:6.2f} ms ({r['speedup']:4.1f}x); kernel at "
                f"{r['kernel_fraction_of_bandwidth']:.2f} of read bandwidth"
            )
            out.append(r)
    return out


def read_bandwidth(reps: int) -> float:
    import torch

    x = torch.ones(256 * 2**20 // 4, dtype=torch.float32)
    return x.numel() * 4 / best_time(x.sum, reps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: what a serving actor uses)"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    set_threads(args.threads)
    from engine import kernels

    ops = kernels.ops()
    if ops is None or ops.paged_decode is None:
        print("CPU kernels unavailable on this machine (see the log)", file=sys.stderr)
        return 1
    reps = 3 if args.quick else 10
    info = machine_info(args.threads)
    bw = read_bandwidth(reps)
    log(
        f"cpu kernels: {args.threads} threads, load {info['load_avg_1_5_15'][0]:.2f}, read "
        f"bandwidth {bw / 1e9:.1f} GB/s"
    )
    result = {
        "benchmark": "cpu_kernels",
        "command": " ".join(sys.argv),
        "machine": info,
        "read_bandwidth_bytes_per_s": bw,
    }
    if ops.tiled_linear is not None:
        log("bf16 GEMM: kernel vs torch bf16 vs widened fp32 (best of reps)")
        rows = [1, 16, 64] if args.quick else [1, 2, 4, 16, 32, 64, 96, 128, 256, 512]
        result["gemm"] = bench_gemm(ops, rows, reps)
    else:
        log("bf16 kernels not built (no AVX-512 or AVX2+FMA): skipping the GEMM section")
    log("paged decode attention: kernel vs gather reference, one layer")
    cases = [(16, 256)] if args.quick else [(1, 256), (16, 256), (16, 1024), (64, 256), (8, 2048)]
    result["attention"] = bench_attention(ops, cases, reps, bw)
    result["load_avg_after"] = load_avg()
    if args.json:
        write_json(args.json, result)
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
