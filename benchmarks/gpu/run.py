"""The GPU run: every section in its own process, in order of priority, inside one wall-clock
budget; one JSON file per section plus summary.json under --out (8 files at most).

Sections: env (card, ceilings) -> parity (transformers on the device) -> decode (MBU, CUDA
graphs) -> prefill (MFU, FP8) -> nixl (VRAM to VRAM between processes) -> kv_tier (the host KV
tier's demote/promote against a pinned copy) -> tests (the GPU-marked and CUDA-relevant tests
under pytest); nixl_probe (UCX's transport per setting) only when named with --only. A section
that fails or runs out of time is recorded as such and the run goes on. `--device cpu --quick`
runs the same code on small shapes: that dry run is a test in `make test`, so no GPU minute is
spent on a script that does not run.

    bash benchmarks/gpu/run.sh                       # on the GPU machine, OUT=... for the folder
    bash benchmarks/gpu/run.sh --device cpu --quick  # here
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks.gpu.common import REPO, log, write_json

# (name, seconds allowed on the GPU); the budget below caps their sum.
SECTIONS = [("env", 45), ("parity", 100), ("decode", 110), ("prefill", 90), ("nixl", 60),
            ("kv_tier", 60), ("tests", 240)]  # fmt: skip
# Diagnostics run only when named (`--only nixl_probe`): 8 files at most come back.
EXTRA_SECTIONS = [("nixl_probe", 80)]
# Which UCX transport carries VRAM reads between two processes decides NIXL's bandwidth: the
# probe reads small caches with UCX logging on, as tandem runs (cuda_ipc's get allowed,
# kv_transfer.nixl.allow_cuda_ipc_reads), then with it off as UCX has it without NVLink
# (software emulation through host memory: run 3's 0.0007 of a device copy).
PROBES = {
    "default": {"UCX_LOG_LEVEL": "info"},
    "cuda_ipc_get_off": {"UCX_LOG_LEVEL": "info", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"},
}
TEST_WORKERS = 4  # of the GPU machine's 16 cores; each worker holds a CUDA context
MODULES = {"env": "benchmarks.gpu.env_probe", "nixl": "benchmarks.gpu.nixl_bandwidth"}
TEST_FILES = [
    "tests/engine/test_triton_attention.py", "tests/engine/test_triton_fused.py",
    "tests/engine/test_cuda_graphs.py", "tests/engine/test_decode_ahead.py",
    "tests/engine/test_decode_ahead_live.py",
    "tests/kv_transfer/test_kv_transfer.py", "tests/workers/test_handoff.py",
    "tests/engine/test_parity_hf.py", "tests/engine/test_kv_host_cache.py",
    "tests/workers/test_prefix_pull.py",
]  # fmt: skip


def run_section(name: str, args, limit: float) -> dict:
    t0 = time.perf_counter()
    if name == "nixl_probe":
        return probe_nixl(args, limit)
    if name == "tests":
        cmd = tests_command(args)
    else:
        cmd = [sys.executable, "-m", MODULES.get(name, f"benchmarks.gpu.{name}"),
               "--device", args.device, "--out", str(args.out)]  # fmt: skip
        if name == "nixl":
            cmd[-1] = str(Path(args.out) / "nixl.json")
        if args.quick:
            cmd.append("--quick")
    log(f"section {name}: up to {limit:.0f} s")
    # NIXL: UCX prints the protocol and transport it picked for each transfer kind; kept
    # (the tail) in nixl.json, since the transport decides the bandwidth.
    env = dict(os.environ, UCX_PROTO_INFO="y") if name == "nixl" else None
    err = subprocess.PIPE if name == "nixl" else None
    try:
        proc = subprocess.run(cmd, cwd=REPO, timeout=limit, env=env, stderr=err, text=True)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        if name == "nixl":
            attach_log(Path(args.out) / "nixl.json", proc.stderr)
    except subprocess.TimeoutExpired:
        status = "timed out"
    if name == "tests":
        write_json(args.out, "tests.json", junit_summary(Path(args.out) / ".junit.xml"))
    return {"status": status, "seconds": round(time.perf_counter() - t0, 1)}


def probe_nixl(args, limit: float) -> dict:
    t0, result = time.perf_counter(), {}
    for label, extra in PROBES.items():
        out = Path(args.out) / f".probe-{label}.json"
        cmd = [sys.executable, "-m", MODULES["nixl"], "--device", args.device, "--quick",
               "--out", str(out)]  # fmt: skip
        try:
            proc = subprocess.run(cmd, cwd=REPO, timeout=limit / len(PROBES), text=True,
                                  env=dict(os.environ, **extra), capture_output=True)  # fmt: skip
            log_text, status = proc.stdout + proc.stderr, f"exit {proc.returncode}"
        except subprocess.TimeoutExpired as e:
            log_text, status = str(e.stderr or ""), "timed out"
        data = json.loads(out.read_text()) if out.exists() else {}
        out.unlink(missing_ok=True)
        keep = [ln for ln in log_text.splitlines() if "ucx" in ln.lower() or "transport" in ln]
        result[label] = {"env": extra, "status": status, "ratio": data.get("ratio"),
                         "best_gb_per_s": data.get("best_gb_per_s"),
                         "byte_exact": data.get("byte_exact"),
                         "log": (keep or log_text.splitlines())[-40:]}  # fmt: skip
    write_json(args.out, "nixl_probe.json", result)
    return {"status": "ok", "seconds": round(time.perf_counter() - t0, 1)}


def attach_log(path: Path, text: str) -> None:
    sys.stderr.write(text[-4000:])
    if path.exists():
        data = json.loads(path.read_text())
        lines = [ln for ln in text.splitlines() if "ucp" in ln.lower() or "ucx" in ln.lower()]
        data["ucx_log"] = (lines or text.splitlines())[-80:]
        path.write_text(json.dumps(data, indent=1) + "\n")


def tests_command(args) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TEST_FILES,
           f"--junitxml={Path(args.out) / '.junit.xml'}", "-o", "addopts=-ra"]  # fmt: skip
    if args.quick:  # on a CPU every GPU-marked test skips: this checks the plumbing only
        cmd += ["-m", "gpu"]
    elif _xdist_usable():  # files over 4 workers (tests/xdist_scopes.py): run 6's first call
        cmd += ["-n", str(TEST_WORKERS)]  # spent its 200 s compiling Triton kernels in one
    return cmd


def _xdist_usable() -> bool:
    """pytest-xdist importable (carried in .whl) beside a pytest it supports (>= 7)."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("xdist") is None:
        return False
    try:
        return int(importlib.metadata.version("pytest").split(".")[0]) >= 7
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False


def junit_summary(path: Path) -> dict:
    if not path.exists():
        return {"error": "pytest wrote no report"}
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "failed" if child.tag != "skipped" else "skipped"
                detail = (child.get("message") or child.text or "")[:400]
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}",
                      "outcome": outcome, "detail": detail, "s": case.get("time")})  # fmt: skip
    path.unlink()
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "skipped")}
    slowest = sorted(cases, key=lambda c: -float(c["s"] or 0))[:10]
    return {**counts, "cases": [c for c in cases if c["outcome"] != "passed"],
            "slowest": [(c["test"], c["s"]) for c in slowest],
            "passed_tests": [c["test"] for c in cases if c["outcome"] == "passed"]}  # fmt: skip


def headline(out: Path) -> dict:
    """The numbers the README quotes, read back from the section files."""

    def load(name):
        p = out / name
        return json.loads(p.read_text()) if p.exists() else {}

    env, dec, pre = load("env.json"), load("decode.json"), load("prefill.json")
    nx, par, tests = load("nixl.json"), load("parity.json"), load("tests.json")
    tier = load("kv_tier.json")
    rows = {r["batch"]: r for r in dec.get("rows", [])}
    return {
        "card": (env.get("gpu") or {}).get("name"),
        "copy_rw_gb_per_s": (env.get("copy") or {}).get("rw_gb_per_s"),
        "gemm_bf16_tflops": (env.get("gemm_bf16") or {}).get("tflops"),
        "parity_fp32_exact": par.get("fp32_exact"),
        "decode_mbu": {b: r.get("mbu_step_graphs") for b, r in rows.items()},
        "decode_mbu_steady": {b: r.get("mbu_step_steady") for b, r in rows.items()},
        "decode_ahead_gain": {
            b: (r.get("step_steady_no_ahead_s") or 0) / r["step_steady_s"]
            for b, r in rows.items()
            if r.get("step_steady_s")
        },  # fmt: skip
        "decode_graphs_speedup": {b: r.get("graphs_speedup") for b, r in rows.items()},
        "prefill_mfu": [r.get("mfu") for r in (pre.get("bf16") or {}).get("rows", [])],
        "fp8_speedup": pre.get("fp8_speedup"),
        "nixl_ratio": nx.get("ratio"),
        "kv_tier_vs_pinned_copy": {k: tier.get(f"{k}_vs_copy") for k in ("demote", "promote")},
        "kv_tier_promote_overlap": (tier.get("promote_overlap") or {}).get("overlap"),
        "tests": {k: tests.get(k) for k in ("passed", "failed", "skipped")},
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results/gpu")
    ap.add_argument("--budget", type=float, default=400, help="seconds for all sections")
    ap.add_argument("--only", nargs="+", choices=[s for s, _ in SECTIONS + EXTRA_SECTIONS])
    args = ap.parse_args(argv)
    args.out = Path(args.out).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    start, results = time.perf_counter(), {}
    for name, limit in SECTIONS + EXTRA_SECTIONS:
        wanted = name in args.only if args.only else (name, limit) in SECTIONS
        if not wanted:
            continue
        left = args.budget - (time.perf_counter() - start)
        if left < 10:
            results[name] = {"status": "skipped: the budget is spent"}
            continue
        # A section named alone (a rerun) may use the whole budget.
        limit = left if args.only and len(args.only) == 1 else limit
        results[name] = run_section(name, args, min(limit * (3 if args.quick else 1), left))
    summary = {
        "device": args.device,
        "quick": args.quick,
        "sections": results,
        "seconds": round(time.perf_counter() - start, 1),
        "headline": headline(args.out),
    }
    write_json(args.out, "summary.json", summary)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
