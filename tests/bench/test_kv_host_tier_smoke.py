"""benchmarks/kv_host_tier.py on a tiny model (three conversations, two turns, an 8-block
device cache): the run with the host KV tier prefills fewer prompt tokens than the one without,
by exactly the blocks it promoted, and the answers are the same in both (the script exits
non-zero otherwise). Run in this process: a fresh one would spend most of the test importing."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks import kv_host_tier


def test_host_tier_prefills_less_and_answers_the_same(make_tiny_model, tmp_path: Path) -> None:
    out = tmp_path / "kv_host_tier.json"
    argv = ["--json", str(out), "--model", str(make_tiny_model("llama"))]
    argv += ["--conversations", "3", "--turns", "2", "--first-tokens", "40"]
    argv += ["--user-tokens", "8", "--answer-tokens", "4", "--num-blocks", "8"]
    argv += ["--max-num-seqs", "1", "--host-gb", "0.01"]
    argv += ["--threads", str(torch.get_num_threads())]  # leave this process's setting alone
    assert kv_host_tier.main(argv) == 0
    r = json.loads(out.read_text())
    off, on = r["off"], r["on"]
    assert "host_promotions" not in off and on["host_promotions"] > 0
    saved = off["prefill_tokens_computed"] - on["prefill_tokens_computed"]
    assert saved == on["host_hit_tokens"] > 0
    assert on["cached_tokens"] == on["prompt_tokens"] - on["prefill_tokens_computed"]
    assert r["prefill_ratio"] > 1
