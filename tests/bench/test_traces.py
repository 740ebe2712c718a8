"""Trace loading and scaling: a small CSV written here, and the real Azure traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.traces import (
    TraceRequest,
    load_trace,
    parse_timestamp,
    scale_trace,
    summarize_trace,
)

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
CODE = TRACES / "azure_llm_code_2023.csv"
CONV = TRACES / "azure_llm_conv_2023.csv"

SMALL = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:05.9799601,7,1
2023-11-16 18:18:04.4799600,100,250
"""


@pytest.fixture
def small_csv(tmp_path: Path) -> Path:
    path = tmp_path / "small.csv"
    path.write_text(SMALL)
    return path


def test_load_small_trace_relative_arrivals_and_lengths(small_csv):
    t = load_trace(small_csv)
    assert [(r.prompt_len, r.output_len) for r in t] == [(4808, 10), (3180, 8), (7, 1), (100, 250)]
    arrivals = [r.arrival_s for r in t]
    assert arrivals == pytest.approx([0.0, 0.052, 2.0000001, 60.5], abs=1e-9)
    assert arrivals[0] == 0.0
    # Sub-microsecond digits survive (a float of epoch seconds would lose them).
    assert arrivals[2] - 2.0 == pytest.approx(1e-7, abs=1e-9)


def test_load_trace_limit_sorts_and_rejects_bad_files(tmp_path, small_csv):
    assert len(load_trace(small_csv, limit=2)) == 2
    shuffled = tmp_path / "shuffled.csv"
    lines = SMALL.splitlines()
    shuffled.write_text("\n".join([lines[0], lines[3], lines[1], lines[2]]) + "\n")
    t = load_trace(shuffled)
    assert [r.prompt_len for r in t] == [4808, 3180, 7]
    assert [r.arrival_s for r in t] == pytest.approx([0.0, 0.052, 2.0000001])

    numeric = tmp_path / "numeric.csv"
    numeric.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,Extra\n100.5,3,4,x\n102,5,6,y\n")
    assert load_trace(numeric) == [TraceRequest(0.0, 3, 4), TraceRequest(1.5, 5, 6)]

    missing = tmp_path / "missing.csv"
    missing.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.9,4\n")
    with pytest.raises(ValueError, match="GeneratedTokens"):
        load_trace(missing)
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,4,x\n")
    with pytest.raises(ValueError, match=":2:"):
        load_trace(bad)
    empty = tmp_path / "empty.csv"
    empty.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(ValueError, match="no requests"):
        load_trace(empty)


def test_parse_timestamp_keeps_seven_digits():
    w1, f1 = parse_timestamp("2023-11-16 18:17:03.9799600")
    w2, f2 = parse_timestamp("2023-11-16 18:17:04.0319600")
    assert (w2 - w1) + (f2 - f1) == pytest.approx(0.052, abs=1e-12)
    assert parse_timestamp("2023-11-16 18:17:03") == (w1, 0.0)
    with pytest.raises(ValueError):
        parse_timestamp("yesterday")


def test_scale_trace_lengths_times_caps_and_count(small_csv):
    t = load_trace(small_csv)
    s = scale_trace(t, length_scale=0.1, time_scale=2.0)
    # round(480.8)=481, round(1.0)=1; round(0.7)=1 and round(0.1)=0 -> at least 1.
    assert [(r.prompt_len, r.output_len) for r in s] == [(481, 1), (318, 1), (1, 1), (10, 25)]
    assert [r.arrival_s for r in s] == pytest.approx([0.0, 0.104, 4.0000002, 121.0])
    capped = scale_trace(t, max_input=1000, max_output=9, num_requests=3)
    assert [(r.prompt_len, r.output_len) for r in capped] == [(1000, 9), (1000, 8), (7, 1)]
    assert scale_trace(t) == t
    assert t[0].prompt_len == 4808  # the input is not mutated
    for bad in ({"length_scale": 0}, {"time_scale": -1}, {"max_input": 0}, {"num_requests": 0}):
        with pytest.raises(ValueError):
            scale_trace(t, **bad)


def test_summarize_trace(small_csv):
    s = summarize_trace(load_trace(small_csv))
    assert s.num_requests == 4
    assert s.span_s == pytest.approx(60.5)
    assert s.rate_rps == pytest.approx(3 / 60.5)
    assert s.mean_prompt_len == pytest.approx((4808 + 3180 + 7 + 100) / 4)
    assert s.mean_output_len == pytest.approx((10 + 8 + 1 + 250) / 4)
    assert summarize_trace([TraceRequest(0.0, 1, 1)]).to_dict()["rate_rps"] == "inf"


def test_trace_request_validation():
    with pytest.raises(ValueError):
        TraceRequest(-1.0, 1, 1)
    with pytest.raises(ValueError):
        TraceRequest(0.0, -1, 1)


needs_traces = pytest.mark.skipif(not CODE.exists(), reason=f"no shared traces at {TRACES}")


@needs_traces
def test_real_code_trace():
    t = load_trace(CODE)
    assert len(t) == 8819
    assert (t[0].arrival_s, t[0].prompt_len, t[0].output_len) == (0.0, 4808, 10)
    assert (t[1].prompt_len, t[1].output_len) == (3180, 8)
    assert t[1].arrival_s == pytest.approx(0.052, abs=1e-9)
    assert [r.arrival_s for r in t] == sorted(r.arrival_s for r in t)
    s = summarize_trace(t)
    # 18:17:03.9799600 -> 19:14:19.9280160 (README: ~57 min, prompts ~2048, outputs ~28)
    assert s.span_s == pytest.approx(3435.948056, abs=1e-6)
    assert 2000 < s.mean_prompt_len < 2100
    assert 25 < s.mean_output_len < 31
    first = load_trace(CODE, limit=100)
    assert first == t[:100]
    scaled = scale_trace(
        t, length_scale=0.05, time_scale=10.0, max_input=128, max_output=16, num_requests=50
    )
    assert len(scaled) == 50
    assert (scaled[0].prompt_len, scaled[0].output_len) == (128, 1)  # 240.4 capped; 0.5 -> 1
    assert scaled[1].arrival_s == pytest.approx(0.52, abs=1e-8)
    assert all(1 <= r.prompt_len <= 128 and 1 <= r.output_len <= 16 for r in scaled)


@needs_traces
def test_real_conv_trace():
    t = load_trace(CONV, limit=3)
    assert [(r.prompt_len, r.output_len) for r in t[:2]] == [(374, 44), (396, 109)]
    assert t[1].arrival_s == pytest.approx(4.314579, abs=1e-9)  # 50.9951690 - 46.6805900
    s = summarize_trace(load_trace(CONV))
    assert s.num_requests == 19366
    assert 1100 < s.mean_prompt_len < 1200
    assert 190 < s.mean_output_len < 230


# The first rows of Azure 2024's week-long traces as the dataset's own notebook prints them
# (github.com/Azure/AzurePublicDataset, analysis/AzureLLMInferenceDataset2024.ipynb: the code
# trace's rows 0-4; the conversation trace's row 0, whose second has no fraction).
AZURE_2024 = """TIMESTAMP,ContextTokens,GeneratedTokens
2024-05-10 00:00:00.009930+00:00,2162,5
2024-05-10 00:00:00.017335+00:00,2399,6
2024-05-10 00:00:00.022314+00:00,76,15
2024-05-10 00:00:00.037845+00:00,2376,1
2024-05-10 00:00:00.083890+00:00,7670,8
2024-05-10 00:00:01+00:00,1452,3
"""


def test_azure_2024_rows_with_a_utc_offset_are_read(tmp_path):
    path = tmp_path / "AzureLLMInferenceTrace_code_1week.csv"
    path.write_text(AZURE_2024)
    t = load_trace(path)
    assert [r.prompt_len for r in t] == [2162, 2399, 76, 2376, 7670, 1452]
    assert [r.arrival_s for r in t] == pytest.approx(
        [0.0, 0.007405, 0.012384, 0.027915, 0.07396, 0.99007], abs=1e-9
    )


@pytest.mark.parametrize(
    ("text", "same_as"),
    [
        ("2024-05-10T00:00:01Z", "2024-05-10 00:00:01"),
        ("2024-05-10 02:00:01+02:00", "2024-05-10 00:00:01"),
        ("2024-05-09 19:00:01-0500", "2024-05-10 00:00:01"),
        ("2024-05-10 00:00:00.009930+00:00", "2024-05-10 00:00:00.009930"),
    ],
)
def test_a_utc_offset_is_taken_off_so_zones_keep_their_true_spacing(text, same_as):
    assert parse_timestamp(text) == parse_timestamp(same_as)


@pytest.mark.parametrize(
    "text", ["2024-02-30 00:00:00", "2024-05-10 00:00:00.x", "2024-05-10 00:00:00+5", "5/10/24"]
)
def test_an_unreadable_or_impossible_timestamp_is_refused_by_its_text(text):
    with pytest.raises(ValueError, match="unreadable timestamp"):
        parse_timestamp(text)


def _seconds_trace(path: Path, times: list[float]) -> Path:
    rows = [f"{t},{100 + i},{1 + i}" for i, t in enumerate(times)]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("in_order", [True, False], ids=["sorted", "unsorted"])
def test_a_window_read_keeps_what_a_cut_after_reading_keeps(tmp_path, in_order):
    times = [1000.0 + 0.5 * i for i in range(200)]  # 100 s of arrivals
    if not in_order:  # the earliest row last: the window must still be relative to it
        times = times[1:] + times[:1]
    path = _seconds_trace(tmp_path / "t.csv", times)
    whole = load_trace(path)
    cut = [r for r in whole if 20.0 <= r.arrival_s < 50.0]
    assert load_trace(path, start_s=20.0, duration_s=30.0) == cut
    assert len(cut) == 60 and cut[0].arrival_s == 20.0
    assert load_trace(path, start_s=95.0) == [r for r in whole if r.arrival_s >= 95.0]
    with pytest.raises(ValueError, match="no requests in the window"):
        load_trace(path, start_s=500.0)
    with pytest.raises(ValueError, match="duration_s > 0"):
        load_trace(path, duration_s=0.0)
