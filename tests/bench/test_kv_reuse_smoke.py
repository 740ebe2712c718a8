"""benchmarks/kv_reuse.py on a tiny model (two conversations, two turns): the run with the
decode worker's prefix cache reads fewer bytes than the one that reads every block, and the
answers are the same in both (the script exits non-zero otherwise)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_reuse_reads_less_and_answers_the_same(make_tiny_model, tmp_path: Path) -> None:
    out = tmp_path / "kv_reuse.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "kv_reuse.py"), "--json", str(out)]
    cmd += ["--model", str(make_tiny_model("llama")), "--conversations", "2", "--turns", "2"]
    cmd += ["--first-tokens", "40", "--user-tokens", "8", "--answer-tokens", "4"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    base, reuse = result["base"], result["reuse"]
    assert base["reused_blocks"] == 0 and reuse["reused_blocks"] > 0
    assert reuse["read_blocks"] + reuse["reused_blocks"] == base["read_blocks"]
    assert reuse["bytes_read"] < base["bytes_read"] and result["bytes_ratio"] > 1
