"""The small CPU ops of a decode layer against another commit's, in the same run.

A batch-1 decode step of a small model spends most of its time streaming weights, and the rest
in ops too small to share between threads: decode attention over the paged cache, SiLU-and-
multiply, the residual add + RMSNorm, RoPE. This times each of them, and the head's GEMV
(the weights streamed from memory: int8-w8a8, weight-only int8, bf16), on SmolLM2-135M's shapes
(9 query heads on 3 kv heads of 64, hidden 576, intermediate 1536, bf16), for this tree and
for `--ref` (its `engine/` materialized with `git archive` in a temporary folder, its kernels
built in a cache folder of their own), rounds alternated, and prints new / ref per op and
thread count. Times are per call from Python (a few microseconds of call overhead included).

Usage: `python benchmarks/cpu_ops_ab.py [--ref REV] [--rounds 2] [--threads 1,2] [--json OUT]`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONTEXTS = (64, 512, 2048)


def best_us(fn, n: int = 300) -> float:
    for _ in range(30):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def measure(threads: list[int]) -> dict:
    """{"<threads>T <op>": microseconds} for the tree on sys.path (a child process)."""
    import torch

    from engine.kernels import ops

    k = ops()
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(160, 16, 3, 64, generator=g).bfloat16()
    vc = torch.randn(160, 16, 3, 64, generator=g).bfloat16()
    q = torch.randn(1, 15, 64, generator=g).bfloat16()[:, :9]  # a view into a fused qkv
    tables = torch.randperm(160, generator=g).view(1, 160)
    gu = torch.randn(1, 3072, generator=g).bfloat16()
    x, w = torch.randn(1, 576, generator=g).bfloat16(), torch.randn(576, generator=g).bfloat16()
    qkv = torch.randn(1, 15, 64, generator=g).bfloat16()
    cos, sin = torch.randn(1, 64, generator=g), torch.randn(1, 64, generator=g)
    heads = head_weights(g)

    def head(x, w, s):
        return k.gemv_q8(x, w, s, None) if s is not None and s.dim() == 2 else k.gemv(x, w, s, None)

    out = {}
    for t in threads:
        torch.set_num_threads(t)
        for ctx in CONTEXTS:
            lens = torch.tensor([ctx])
            out[f"{t}T attention ctx {ctx}"] = best_us(
                lambda lens=lens: k.paged_decode(q, kc, vc, None, None, tables, lens, 0.125, 0)
            )
        out[f"{t}T silu_mul"] = best_us(lambda: k.silu_mul(gu))
        out[f"{t}T add_rms_norm"] = best_us(lambda: k.add_rms_norm(x, x, w, 1e-5))
        out[f"{t}T rope_"] = best_us(lambda: k.rope_(qkv, cos, sin, 12))
        for name, (weights, scale) in heads.items():
            out[f"{t}T head {name}"] = best_us(lambda w=weights, s=scale: head(x, w, s), n=20)
    return out


def head_weights(g) -> dict:
    """SmolLM2's tied head (49,152 x 576): too big for the cache, so it measures how the GEMVs
    stream weights from memory. int8-w8a8 with group-32 scales (the int8 head's layout),
    weight-only int8 with per-row scales, and bf16."""
    import torch

    n, d = 49152, 576
    q = torch.randint(-127, 128, (n, d), dtype=torch.int8, generator=g)
    bf = torch.randn(n, d, generator=g).bfloat16()
    return {
        "int8-w8a8": (q, torch.rand(n, d // 32, generator=g)),
        "int8": (q, torch.rand(n, generator=g)),
        "bf16": (bf, None),
    }


def run_tree(tree: Path, ext_dir: str | None, threads: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    if ext_dir:
        env["TORCH_EXTENSIONS_DIR"] = ext_dir
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--threads", threads]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref", default="HEAD~1", help="the commit to compare with")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure([int(t) for t in args.threads.split(",")])))
        return 0
    with tempfile.TemporaryDirectory(prefix="tandem-ab-") as tmp:
        ref_tree = Path(tmp) / "tree"
        ref_tree.mkdir()
        archive = subprocess.run(
            ["git", "archive", args.ref, "engine"], cwd=REPO, capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(ref_tree)], input=archive.stdout, check=True)
        rounds: dict[str, list[dict]] = {"new": [], "ref": []}
        for r in range(args.rounds):
            rounds["new"].append(run_tree(REPO, None, args.threads))
            rounds["ref"].append(run_tree(ref_tree, str(Path(tmp) / "ext"), args.threads))
            print(f"round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    result = {"ref": args.ref, "rounds": rounds, "ratio_new_over_ref": {}}
    for op in rounds["new"][0]:
        new = min(x[op] for x in rounds["new"])
        ref = min(x[op] for x in rounds["ref"])
        result["ratio_new_over_ref"][op] = new / ref
        print(f"{op:28s} new {new:8.1f} us   ref {ref:8.1f} us   new/ref {new / ref:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
