"""benchmarks/kv_host_tier.py on a tiny model (three conversations, two turns, an 8-block
device cache): the run with the host KV tier prefills fewer prompt tokens than the one without,
by exactly the blocks it promoted, and the answers are the same in both (the script exits
non-zero otherwise)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_host_tier_prefills_less_and_answers_the_same(make_tiny_model, tmp_path: Path) -> None:
    out = tmp_path / "kv_host_tier.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "kv_host_tier.py"), "--json", str(out)]
    cmd += ["--model", str(make_tiny_model("llama")), "--conversations", "3", "--turns", "2"]
    cmd += ["--first-tokens", "40", "--user-tokens", "8", "--answer-tokens", "4"]
    cmd += ["--num-blocks", "8", "--max-num-seqs", "1", "--host-gb", "0.01"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    off, on = r["off"], r["on"]
    assert "host_promotions" not in off and on["host_promotions"] > 0
    saved = off["prefill_tokens_computed"] - on["prefill_tokens_computed"]
    assert saved == on["host_hit_tokens"] > 0
    assert on["cached_tokens"] == on["prompt_tokens"] - on["prefill_tokens_computed"]
    assert r["prefill_ratio"] > 1
