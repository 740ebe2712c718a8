"""Trace loading for the simulator: Mooncake JSONL (and its errors), the Azure CSVs through
bench.traces, format detection, cutting and scaling; prefix-cache hits from hash_ids."""

from __future__ import annotations

import json

import pytest
from sim_fakes import FixedPolicy, ScriptedPolicy, make_profile

from cluster.simulator.prefix_cache import PrefixCache, cached_tokens
from cluster.simulator.run import SimConfig, simulate
from cluster.simulator.traces import (
    SimRequest,
    detect_format,
    load_requests,
    shape_requests,
    superimpose,
)

approx = pytest.approx


def _jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_mooncake_lines_become_requests_in_arrival_order(tmp_path):
    path = _jsonl(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 5000, "input_length": 700, "output_length": 3, "hash_ids": [1, 2]},
            {"timestamp": 2000, "input_length": 100, "output_length": 0, "hash_ids": [9]},
            "",
            {"timestamp": 2500, "input_length": 50, "output_length": 7},
        ],
    )
    reqs = load_requests(path)
    assert reqs == [
        SimRequest(0.0, 100, 1, (9,)),  # output 0 -> 1: every request makes its first token
        SimRequest(0.5, 50, 7, ()),
        SimRequest(3.0, 700, 3, (1, 2)),
    ]


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"timestamp": 1, "input_length": 5}', "output_length"),
        ('{"timestamp": "x", "input_length": 5, "output_length": 1}', "timestamp"),
        ('{"timestamp": 1, "input_length": -5, "output_length": 1}', "input_length"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1.5}', "output_length"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": "a"}', "hash_ids"),
    ],
)
def test_a_bad_mooncake_line_is_named(tmp_path, line, message):
    good = {"timestamp": 0, "input_length": 5, "output_length": 1}
    path = _jsonl(tmp_path / "t.jsonl", [good, line])
    with pytest.raises(ValueError, match=message) as e:
        load_requests(path, "mooncake")
    assert "t.jsonl:2" in str(e.value)


def test_formats_are_detected_by_extension_then_content(tmp_path):
    assert detect_format(tmp_path / "a.csv") == "azure"
    assert detect_format(tmp_path / "a.jsonl") == "mooncake"
    plain = tmp_path / "trace.txt"
    plain.write_text('\n{"timestamp": 0, "input_length": 5, "output_length": 1}\n')
    assert detect_format(plain) == "mooncake"
    assert load_requests(plain) == [SimRequest(0.0, 5, 1)]
    plain.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1.5,10,2\n")
    assert detect_format(plain) == "azure"
    with pytest.raises(ValueError, match="trace format"):
        load_requests(plain, "parquet")
    with pytest.raises(ValueError, match="no trace"):
        load_requests(tmp_path / "missing.csv")


def test_azure_csv_goes_through_bench_traces(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:04.5000000,300,0\n"
        "2023-11-16 18:17:03.2500000,100,20\n"
    )
    assert load_requests(path) == [SimRequest(0.0, 100, 20), SimRequest(1.25, 300, 1)]
    with pytest.raises(ValueError, match="missing column"):
        (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
        load_requests(tmp_path / "bad.csv")


def test_shaping_cuts_rebases_and_scales():
    reqs = [SimRequest(float(t), 1000, 10, (1, 2)) for t in range(10)]
    out = shape_requests(reqs, start_s=2.0, duration_s=4.0, time_scale=2.0, length_scale=0.5)
    assert [r.arrival_s for r in out] == [0.0, 2.0, 4.0, 6.0]
    assert {(r.prompt_len, r.output_len, r.hash_ids) for r in out} == {(500, 5, (1,))}
    assert len(shape_requests(reqs, max_requests=3)) == 3
    for bad in ({"time_scale": 0}, {"length_scale": -1}, {"duration_s": 0}, {"start_s": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            shape_requests(reqs, **bad)
    with pytest.raises(ValueError, match="no requests"):
        shape_requests(reqs, start_s=100.0)


def test_the_prefix_cache_is_an_lru_of_leading_blocks():
    cache = PrefixCache(capacity_blocks=3)
    assert cache.use((1, 2)) == 0
    assert cache.peek((1, 2, 3)) == 2 and cache.peek((3, 1)) == 0
    cache.use((5, 6))  # 1 is the least recently used: evicted
    assert cache.peek((1,)) == 0 and cache.peek((2,)) == 1 and len(cache) == 3
    assert cached_tokens(3, 1536) == 1535  # the last prompt token is always computed
    assert cached_tokens(2, 1536) == 1024


def test_prefix_hits_shorten_prefill_and_steer_the_prefill_choice(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 950, "input_length": 900, "output_length": 1, "hash_ids": []},
        {"timestamp": 1000, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 9]},
        {"timestamp": 2000, "input_length": 1536, "output_length": 1, "hash_ids": [7, 8, 9]},
    ]
    reqs = load_requests(_jsonl(tmp_path / "m.jsonl", rows))
    policy = ScriptedPolicy({"prefill": 2, "decode": 1}, [])
    r = simulate(reqs, make_profile(), policy, SimConfig(interval_s=0.5))
    # 1536 tokens in two chunks (1000 + 536); no hit for the unrelated prompt.
    assert r.ttft_s[0] == approx(0.1536) and r.ttft_s[3] == approx(0.1536)
    # The third shares two blocks (1024 tokens) with the first: it goes to that worker (0)
    # although worker 1 is idle, waits for the 900-token step there (ends at 1.04), then
    # computes its 512 other tokens.
    assert [p[0] for p in r.placements] == [0, 0, 0, 0]
    assert r.ttft_s[2] == approx(0.95 + 0.09 + 0.0512 - 1.0)
    uncached = sum(w.uncached_prompt_tokens for w in policy.windows)
    assert uncached == 1536 + 900 + 512 + 1536


def test_without_block_ids_the_least_queued_prefill_worker_wins():
    reqs = [SimRequest(0.0, 900, 1), SimRequest(0.01, 900, 1)]
    r = simulate(reqs, make_profile(), FixedPolicy(prefill=2, decode=1))
    assert [p[0] for p in r.placements] == [0, 1]
    assert r.ttft_s == [approx(0.09), approx(0.09)]


def test_rate_scale_superimposes_shifted_copies():
    reqs = [SimRequest(float(t), 100 + t, 10, (t,)) for t in range(0, 100, 10)]
    out = shape_requests(reqs, rate_scale=3, rate_jitter_s=5.0, seed=7)
    arrivals = [r.arrival_s for r in out]
    assert len(out) == 30 and arrivals == sorted(arrivals)
    # Each copy is the trace shifted by one offset in [0, 5): same lengths, same gaps.
    by_copy: dict[int, list[SimRequest]] = {}
    for r in out:
        by_copy.setdefault(r.hash_ids[0] // 91, []).append(r)  # ids offset by 91 per copy
    assert sorted(by_copy) == [0, 1, 2]
    for k, copy in by_copy.items():
        offset = copy[0].arrival_s
        assert (offset == 0.0) if k == 0 else (0 <= offset < 5.0)
        assert [r.arrival_s - offset for r in copy] == approx([r.arrival_s for r in reqs])
        assert [r.prompt_len for r in copy] == [r.prompt_len for r in reqs]
    assert out == shape_requests(reqs, rate_scale=3, rate_jitter_s=5.0, seed=7)  # seeded
    assert superimpose(reqs, 1) == reqs
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="rate_scale"):
            superimpose(reqs, bad)
    with pytest.raises(ValueError, match="rate_jitter_s"):
        superimpose(reqs, 2, -1.0)


def test_windows_carry_the_peak_one_second_prompt_burst():
    profile = make_profile()
    # Window [0, 10): 300 tokens in second 2, 1000 + 500 in second 5, 200 in second 9.
    times = [(2.1, 300), (5.0, 1000), (5.9, 500), (9.5, 200), (12.0, 50), (25.0, 1)]
    reqs = [SimRequest(t, n, 2) for t, n in times]
    policy = ScriptedPolicy({"prefill": 1, "decode": 1}, [])
    simulate(reqs, profile, policy, SimConfig(interval_s=10.0))
    assert policy.windows[0].peak_prompt_tokens_1s == 1500
    assert policy.windows[1].peak_prompt_tokens_1s == 50


def test_an_azure_2024_week_is_cut_while_read_to_the_rows_the_cut_keeps(tmp_path):
    """`tandem simulate --trace-start-s/--duration-s` pass the window down to the CSV reader
    (a week of Azure 2024 is 27M rows): the same requests as cutting after a full read."""
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(3000):  # 3000 s at 1 req/s, with Azure 2024's offset timestamps
        rows.append(f"2024-05-10 {i // 3600:02d}:{i // 60 % 60:02d}:{i % 60:02d}.25+00:00,{i},7")
    path = tmp_path / "AzureLLMInferenceTrace_conv_1week.csv"
    path.write_text("\n".join(rows) + "\n")
    whole = load_requests(path)
    read_cut = load_requests(path, start_s=600.0, duration_s=1200.0)
    assert len(read_cut) == 1200 and read_cut[0].prompt_len == 600
    expected = shape_requests(whole, start_s=600.0, duration_s=1200.0)
    assert shape_requests(read_cut, start_s=600.0, duration_s=1200.0) == expected
