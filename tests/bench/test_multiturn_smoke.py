"""benchmarks/multiturn.py's workload and accounting, without a server (the replay through a
live `tandem serve` runs in tests/e2e/test_serve_parity.py on that module's servers):
Mooncake hash ids become prompts that share exactly the trace's prefixes, ShareGPT turns
carry the whole history, the tokens no cache held are counted by block, and /metrics
counters are summed per pool."""

from __future__ import annotations

import gzip
import json
from argparse import Namespace
from pathlib import Path

from benchmarks import multiturn
from benchmarks import multiturn_workload as mw

ROWS = [  # two conversations; the second's turns extend its first; id 0 shared by all
    {"timestamp": 0, "input_length": 1000, "output_length": 50, "hash_ids": [0, 1]},
    {"timestamp": 1, "input_length": 600, "output_length": 9, "hash_ids": [0, 2]},
    {"timestamp": 2, "input_length": 1500, "output_length": 50, "hash_ids": [0, 1, 3]},
    {"timestamp": 3, "input_length": 5000, "output_length": 5, "hash_ids": [0, 1, 3, 4, 5, 6]},
    {"timestamp": 4, "input_length": 1100, "output_length": 7, "hash_ids": [0, 2, 7]},
    {"timestamp": 5, "input_length": 100, "output_length": 7, "hash_ids": [9]},
]


def _trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in ROWS)
    return path


def test_mooncake_prompts_share_exactly_the_traces_prefixes(tmp_path: Path) -> None:
    convs = mw.mooncake_conversations(
        _trace(tmp_path), tokens_per_hash=8, max_blocks=4, conversations=5, turns=4,
        answer_tokens=16, vocab=500,
    )  # fmt: skip
    # The 6-block request is left out (over max_blocks); the lone one makes no conversation.
    assert [[len(p) for p, _ in c] for c in convs] == [[16, 24], [10, 18]]
    assert [[m for _, m in c] for c in convs] == [[16, 16], [9, 7]]
    (a1, _), (a2, _) = convs[0]
    (b1, _), (b2, _) = convs[1]
    assert a2[:16] == a1 and a1[:8] == b1[:8]  # equal hash ids, equal tokens
    assert a1[8:16] != b1[8:16] and b2[:10] == b1  # different ids differ; a cut block is a prefix
    # Block size 8: b1's first block is a1's; a2 holds a1 whole; b2 holds b1's full block.
    prompt_tokens = 16 + 10 + 24 + 18
    ideal = 16 + (10 - 8) + (24 - 16) + (18 - 8)
    assert mw.workload_summary(convs, 8) == {
        "conversations": 2, "requests": 4, "prompt_tokens": prompt_tokens,
        "tokens_no_cache_held": ideal, "reuse_ratio": round(1 - ideal / prompt_tokens, 4),
    }  # fmt: skip


def test_an_engine_always_computes_the_last_tokens_block() -> None:
    same = list(range(100, 116))
    assert mw.ideal_computed([[(same, 1), (same, 1)]], 8) == 16 + 8


def test_sharegpt_turns_carry_the_history(tmp_path: Path) -> None:
    class Tok:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [len(w) for w in text.split()]

    msgs = [("human", "a bb"), ("gpt", "ccc dddd eeeee"), ("human", "ff"), ("gpt", "g h")]
    data = [{"conversations": [{"from": f, "value": v} for f, v in msgs]},
            {"conversations": [{"from": "human", "value": "only one turn"}]}]  # fmt: skip
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    convs = mw.sharegpt_conversations(
        path, Tok(), conversations=5, turns=4, answer_tokens=2, max_message_tokens=8
    )
    assert convs == [[([1, 2], 2), ([1, 2, 3, 4, 5, 2], 2)]]


def test_synthetic_turns_extend_the_previous_prompt() -> None:
    args = Namespace(conversations=2, turns=3, first_tokens=20, user_tokens=5, answer_tokens=4)
    import random

    convs = mw.synthetic_conversations(args, random.Random(0), 300)
    for conv in convs:
        lens = [len(p) for p, _ in conv]
        assert lens == [20, 29, 38]
        assert all(conv[k + 1][0][: lens[k]] == conv[k][0] for k in range(2))


def test_pool_counters_sum_each_role_and_read_total_suffixes() -> None:
    metrics = {
        'tandem_kv_transfer_bytes_total{worker="decode-0",role="decode"}': 100.0,
        'tandem_kv_transfer_bytes_total{worker="decode-1",role="decode"}': 50.0,
        'tandem_kv_transfer_bytes_total{worker="prefill-0",role="prefill"}': 150.0,
        'tandem_prefix_cache_hit_tokens_total{worker="prefill-0",role="prefill"}': 30.0,
        'tandem_prefix_cache_query_tokens_total{worker="prefill-0",role="prefill"}': 120.0,
        'tandem_kv_host_hit_tokens_total{worker="prefill-0",role="prefill"}': 10.0,
        'tandem_kv_reused_blocks_total{worker="decode-0",role="decode"}': 3.0,
        'tandem_kv_read_blocks_total{worker="decode-0",role="decode"}': 9.0,
        # a prefill worker's prefix pulls READ too: every READ counts
        'tandem_kv_prefix_pull_bytes_total{worker="prefill-0",role="prefill"}': 20.0,
    }
    pools = multiturn.pool_counters(metrics)
    assert (
        pools["decode"]["kv_transfer_bytes"] == 150 and pools["prefill"]["kv_transfer_bytes"] == 150
    )
    results = {(0, 0): {"ttft": 0.1, "prompt_tokens": 120, "cached_tokens": 30, "text": "x"},
               (0, 1): {"ttft": 0.3, "prompt_tokens": 40, "cached_tokens": 0, "text": "y"}}  # fmt: skip
    s = multiturn.summarize(results, metrics, 1.0)
    assert s["kv_bytes_read"] == 170 and s["prefill_tokens_computed"] == 130
    assert s["requests"] == [[0, 0, "", 120, 90], [0, 1, "", 40, 40]]
    assert s["prefill_tokens_computed_workers"] == 90
    assert s["hit_ratios"]["prefill"] == {
        "device_hit_ratio": round(20 / 120, 4), "host_hit_ratio": round(10 / 120, 4),
        "query_tokens": 120,
    }  # fmt: skip
    assert s["hit_ratios"]["decode"]["remote_reused_block_ratio"] == 0.25
    assert (s["ttft_ms_p50"], s["ttft_ms_p90"], s["ttft_ms_p50_later_turns"]) == (100, 300, 300)
    today = {**s, "kv_bytes_read": 1000, "ttft_ms_p50": 200.0}
    ratios = multiturn.compare({"today": today, "all-on": s}, {"tokens_no_cache_held": 125})
    assert ratios["acceptance"] == {
        "bytes_at_most_40pct_of_today": True, "prefill_within_5pct_of_no_cache_held": True,
        "ttft_p50_below_today": True,
    }  # fmt: skip
    assert ratios["all-on"]["bytes_vs_today"] == 0.17


def test_the_plot_shows_each_config_against_the_first(tmp_path):
    run = {"kv_bytes_read": 100, "ttft_ms_p50": 50.0, "prefill_tokens_computed": 10}
    runs = {"today": run, "all-on": {k: v / 2 for k, v in run.items()}}
    out = tmp_path / "m.png"
    multiturn.plot(runs, out)
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
