"""The bench client's metric arithmetic against hand-computed timestamps."""

from __future__ import annotations

import json

import pytest

from bench.metrics import (
    RequestRecord,
    compute_metrics,
    itls_from_chunks,
    measure_request,
    meets_slo,
    request_tpot,
    spread_tokens,
    summarize,
)
from engine.slo import ttft_target


def ok_record(
    index: int, ttft: float, e2e: float, out: int, prompt: int = 10, itls=None
) -> RequestRecord:
    return RequestRecord(
        index=index,
        arrival_s=0.0,
        start_s=0.0,
        prompt_len=prompt,
        target_output_len=out,
        output_len=out,
        ttft_s=ttft,
        e2e_s=e2e,
        itls_s=list(itls or []),
    )


def test_measure_request_one_token_per_chunk():
    # Sent at 10.0; chunks at 10.20, 10.25, 10.35, 10.40; [DONE] at 10.45; no usage chunk.
    t = measure_request(10.0, [10.20, 10.25, 10.35, 10.40], 10.45, None)
    assert t.output_len == 4
    assert t.ttft_s == pytest.approx(0.20)
    assert t.e2e_s == pytest.approx(0.45)
    assert t.itls_s == pytest.approx([0.05, 0.10, 0.05])
    # TPOT = (0.45 - 0.20) / (4 - 1)
    assert request_tpot(t.ttft_s, t.e2e_s, t.output_len) == pytest.approx(0.25 / 3)


def test_measure_request_usage_exceeds_chunks_spreads_tokens_evenly():
    # 4 chunks but usage says 6 tokens: the 2 extra go to chunks 2 and 3 (1,2,2,1).
    assert spread_tokens(4, 6) == [1, 2, 2, 1]
    t = measure_request(10.0, [10.20, 10.25, 10.35, 10.40], 10.45, 6)
    assert t.output_len == 6
    assert t.itls_s == pytest.approx([0.025, 0.025, 0.05, 0.05, 0.05])
    assert len(t.itls_s) == t.output_len - 1
    # The ITLs always add up to last chunk - first chunk.
    assert sum(t.itls_s) == pytest.approx(0.20)
    assert request_tpot(t.ttft_s, t.e2e_s, 6) == pytest.approx(0.25 / 5)


def test_measure_request_usage_below_chunks_keeps_chunk_gaps():
    # A server that splits one token's text over two chunks: 4 chunks, 3 tokens.
    t = measure_request(0.0, [1.0, 1.5, 1.6, 2.0], 2.0, 3)
    assert t.output_len == 3
    assert t.itls_s == pytest.approx([0.5, 0.1, 0.4])
    assert request_tpot(t.ttft_s, t.e2e_s, 3) == pytest.approx(0.5)


def test_multi_token_chunks_attribute_gap_evenly_and_first_chunk_extras_are_zero():
    assert itls_from_chunks([1.0, 1.3, 1.4], [1, 3, 1]) == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert itls_from_chunks([1.0, 2.0], [3, 2]) == pytest.approx([0.0, 0.0, 0.5, 0.5])
    assert spread_tokens(1, 5) == [5]
    assert itls_from_chunks([1.0], [5]) == [0.0, 0.0, 0.0, 0.0]
    assert spread_tokens(3, 8) == [1, 4, 3]
    assert spread_tokens(0, 0) == []


def test_measure_request_rejects_impossible_streams():
    with pytest.raises(ValueError):
        measure_request(0.0, [], 1.0, 3)
    with pytest.raises(ValueError):
        measure_request(1.0, [0.5], 2.0, 1)  # token before the send
    with pytest.raises(ValueError):
        measure_request(0.0, [0.5, 0.4], 1.0, 2)  # time going backwards
    with pytest.raises(ValueError):
        itls_from_chunks([0.0, 1.0], [1, 0])


def test_single_token_tpot_is_undefined():
    assert request_tpot(0.1, 0.1, 1) is None
    assert request_tpot(0.1, 0.1, 0) is None
    t = measure_request(0.0, [0.3], 0.31, 1)
    assert t.itls_s == []
    assert t.ttft_s == pytest.approx(0.3)


def test_percentiles_are_numpy_linear_in_ms():
    s = summarize([0.1, 0.2, 0.3, 0.4, 1.0])
    assert s.count == 5
    assert s.mean == pytest.approx(400.0)
    assert s.p50 == pytest.approx(300.0)
    assert s.p90 == pytest.approx(760.0)  # rank 3.6: 400 + 0.6 * 600
    assert s.p99 == pytest.approx(976.0)  # rank 3.96: 400 + 0.96 * 600
    two = summarize([0.010, 0.020])
    assert (two.p50, two.p90, two.p99) == pytest.approx((15.0, 19.0, 19.9))
    empty = summarize([])
    assert empty.to_dict() == {"mean": None, "p50": None, "p90": None, "p99": None, "count": 0}


def _mixed_records() -> list[RequestRecord]:
    return [
        ok_record(0, ttft=0.10, e2e=0.50, out=5, prompt=10, itls=[0.1] * 4),  # TPOT 100 ms
        ok_record(1, ttft=0.30, e2e=0.50, out=3, prompt=20, itls=[0.1, 0.1]),  # TPOT 100 ms
        ok_record(2, ttft=0.05, e2e=0.05, out=1, prompt=30),  # single token: no TPOT
        RequestRecord(
            3,
            0.0,
            0.0,
            40,
            5,
            output_len=2,
            ttft_s=0.01,
            e2e_s=0.02,
            itls_s=[0.01],
            error="ClientPayloadError: dropped",
        ),
        ok_record(4, ttft=0.15, e2e=1.15, out=5, prompt=50, itls=[0.25] * 4),  # TPOT 250 ms
    ]


def test_compute_metrics_counts_throughput_and_latencies():
    m = compute_metrics(_mixed_records(), duration_s=2.0)
    assert (m.completed, m.failed) == (4, 1)
    assert m.total_input_tokens == 10 + 20 + 30 + 50  # the failed request's 40 is not counted
    assert m.total_output_tokens == 5 + 3 + 1 + 5
    assert m.request_throughput == pytest.approx(2.0)
    assert m.output_tok_s == pytest.approx(7.0)
    assert m.input_tok_s == pytest.approx(55.0)
    assert m.total_tok_s == pytest.approx(62.0)
    # TTFT over 100, 300, 50, 150 ms; the failed request's 10 ms is excluded.
    assert m.ttft_ms.mean == pytest.approx(150.0)
    assert m.ttft_ms.p50 == pytest.approx(125.0)
    assert m.ttft_ms.p90 == pytest.approx(255.0)  # rank 2.7: 150 + 0.7 * 150
    # TPOT over 100, 100, 250 ms (the single-token request has none).
    assert m.tpot_ms.count == 3
    assert m.tpot_ms.mean == pytest.approx(150.0)
    assert m.tpot_ms.p50 == pytest.approx(100.0)
    # ITLs pooled over all tokens of completed requests: 4x100, 2x100, 4x250.
    assert m.itl_ms.count == 10
    assert m.itl_ms.mean == pytest.approx((6 * 100 + 4 * 250) / 10)
    assert m.e2e_ms.mean == pytest.approx((500 + 500 + 50 + 1150) / 4)
    # With no SLO, goodput is the request throughput.
    assert m.good_requests == 4
    assert m.goodput_rps == pytest.approx(m.request_throughput)
    json.dumps(m.to_dict(), allow_nan=False)


@pytest.mark.parametrize(
    ("slo_ttft_ms", "slo_tpot_ms", "good"),
    [
        (200.0, 120.0, 2),  # r1 breaks TTFT, r4 breaks TPOT; r2 has no TPOT and passes
        (200.0, None, 3),  # only TTFT applies: r1 out
        (None, 120.0, 3),  # only TPOT applies: r4 out
        (None, 300.0, 4),
        (40.0, None, 0),
        (50.0, 10.0, 1),  # only the single-token request (TTFT 50 <= 50, TPOT undefined)
    ],
)
def test_goodput_applies_only_given_slos(slo_ttft_ms, slo_tpot_ms, good):
    m = compute_metrics(_mixed_records(), 2.0, slo_ttft_ms, slo_tpot_ms)
    assert m.good_requests == good
    assert m.goodput_rps == pytest.approx(good / 2.0)


def test_slo_boundary_is_inclusive_and_failures_never_meet_it():
    r = ok_record(0, ttft=0.25, e2e=1.25, out=3)  # TTFT 250 ms, TPOT 500 ms
    assert meets_slo(r, 250.0, 500.0)
    assert not meets_slo(r, 249.0, None)
    assert not meets_slo(r, None, 499.0)
    failed = RequestRecord(1, 0.0, 0.0, 5, 3, error="HTTP 500")
    assert not failed.ok
    assert not meets_slo(failed, None, None)


def test_a_per_1k_allowance_judges_a_long_prompt_by_its_length():
    short = ok_record(0, ttft=0.9, e2e=1.0, out=1, prompt=500)
    long = ok_record(1, ttft=5.0, e2e=5.1, out=1, prompt=20_000)
    assert ttft_target(1000.0, 250.0, 20_000) == 6000.0
    assert meets_slo(long, 1000.0, None, slo_ttft_ms_per_1k=250.0)
    assert not meets_slo(long, 1000.0, None)  # one target for every prompt: a miss
    m = compute_metrics([short, long], 1.0, 1000.0, None, slo_ttft_ms_per_1k=250.0)
    assert m.good_requests == 2
    assert compute_metrics([short, long], 1.0, 1000.0, None).good_requests == 1


def test_compute_metrics_all_failed_and_bad_duration():
    m = compute_metrics([RequestRecord(0, 0.0, 0.0, 5, 3, error="x")], 1.0, 100.0, 10.0)
    assert (m.completed, m.failed, m.goodput_rps) == (1 - 1, 1, 0.0)
    assert m.ttft_ms.mean is None
    json.dumps(m.to_dict(), allow_nan=False)
    with pytest.raises(ValueError):
        compute_metrics([], 0.0)


def test_record_to_dict_has_the_per_request_fields():
    d = ok_record(7, ttft=0.1, e2e=0.3, out=3, itls=[0.1, 0.1]).to_dict()
    for key in (
        "index",
        "arrival_s",
        "start_s",
        "prompt_len",
        "output_len",
        "ttft_s",
        "tpot_s",
        "e2e_s",
        "itls_s",
        "error",
    ):
        assert key in d
    assert d["tpot_s"] == pytest.approx(0.1)
