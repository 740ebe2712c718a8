"""The GPU run's dry run: `benchmarks/gpu/run.sh --device cpu --quick` runs every section on
this CPU (small shapes, the Triton kernels under the interpreter) so that no GPU minute is
spent on a script that does not run. Each section must finish and write what the README's GPU
section reads; at most 8 files come back from the GPU machine, so at most 8 are written."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-run")
    env = dict(os.environ, OUT=str(out))
    proc = subprocess.run(
        ["bash", "benchmarks/gpu/run.sh", "--device", "cpu", "--quick", "--budget", "400"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _load(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


def test_every_section_runs_and_writes_its_file(dry_run):
    summary = _load(dry_run, "summary.json")
    assert {k: v["status"] for k, v in summary["sections"].items()} == {
        s: "ok" for s in ("env", "parity", "decode", "prefill", "nixl", "kv_tier", "tests")
    }
    files = sorted(p.name for p in dry_run.iterdir())
    assert len(files) <= 8, files
    assert all(name.endswith(".json") for name in files), files


def test_the_results_hold_what_the_readme_quotes(dry_run):
    parity = _load(dry_run, "parity.json")
    assert parity["fp32_exact"] and parity["graphs_equal_eager"]
    assert all(r["blocks_freed"] for r in parity["rows"])
    decode = _load(dry_run, "decode.json")
    assert [r["batch"] for r in decode["rows"]] == [1, 4]
    assert all(r["bound_s"] > 0 and r["mbu_step_graphs"] > 0 for r in decode["rows"])
    assert decode["rows"][0]["profile_eager"]["rows"], "no profile"
    # The steady steps ran with decode-ahead (launched ahead) and without.
    assert all(r["ahead_launched"] > 0 and r["step_steady_no_ahead_s"] > 0 for r in decode["rows"])
    sweep = decode["kernel_sweep"]  # the paged decode kernel's variants, by the interpreter
    assert {(r["split_len"], r["block_n"]) for r in sweep["rows"]} >= {(32, 32), (128, 32)}
    assert sweep["outputs_agree"], sweep["max_abs_diff"]
    prefill = _load(dry_run, "prefill.json")
    assert prefill["fp8"]["layout"] == "fp8" and prefill["fp8_speedup"]
    nixl = _load(dry_run, "nixl.json")
    assert nixl["byte_exact"] and nixl["mem_type"] == "DRAM"
    tier = _load(dry_run, "kv_tier.json")
    assert tier["byte_exact"] and tier["every_block_freed"] and tier["promote_gb_per_s"] > 0
    tests = _load(dry_run, "tests.json")
    # On a CPU every GPU-marked test skips, each with its reason on record.
    assert tests["skipped"] >= 3 and tests["failed"] == 0
    assert all(c["detail"] for c in tests["cases"] if c["outcome"] == "skipped")
