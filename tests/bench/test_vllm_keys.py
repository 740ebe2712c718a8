"""The `vllm bench serve` keys of the result JSON, against numbers computed by hand on a small
fixed set of request records (times chosen exact in binary so equalities hold), the goodput
SLOs, the flags that select them, and the keys in a real run against the stub server."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from test_bench_serve_e2e import Plan, StubServer

from bench.cli import config_from_args
from bench.client import run_benchmark
from bench.config import BenchConfig
from bench.metrics import RequestRecord, compute_metrics
from bench.report import BenchResult, format_report
from bench.vllm_compat import (
    parse_goodput,
    parse_metric_percentiles,
    parse_percentile_metrics,
    percentile_key,
    vllm_keys,
)
from cluster.cli import build_parser

DURATION = 2.0


def _records() -> list[RequestRecord]:
    """Three completed requests and one failure.

    r0: TTFT 125 ms, E2E 1250 ms, 10 tokens -> TPOT 1125/9 = 125 ms, 9 ITLs of 125 ms
    r1: TTFT 250 ms, E2E  625 ms,  4 tokens -> TPOT  375/3 = 125 ms, 3 ITLs of 125 ms
    r2: TTFT 375 ms, E2E  375 ms,  1 token  -> no TPOT, no ITL
    r3: failed (its 999 prompt tokens count nowhere)
    """
    r0 = RequestRecord(0, 0.0, 0.0, 100, 10, 10, 0.125, 1.25, [0.125] * 9)
    r1 = RequestRecord(1, 0.1, 0.1, 50, 4, 4, 0.25, 0.625, [0.125] * 3)
    r2 = RequestRecord(2, 0.2, 0.2, 20, 1, 1, 0.375, 0.375, [])
    r3 = RequestRecord(3, 0.3, 0.3, 999, 8, error="HTTP 500: boom")
    return [r0, r1, r2, r3]


def test_throughput_keys_by_hand():
    keys = vllm_keys(_records(), DURATION)
    assert keys["duration"] == 2.0
    assert keys["completed"] == 3
    assert keys["total_input_tokens"] == 170  # 100 + 50 + 20
    assert keys["total_output_tokens"] == 15  # 10 + 4 + 1
    assert keys["request_throughput"] == 1.5
    assert keys["output_throughput"] == 7.5
    assert keys["total_token_throughput"] == 92.5  # 185 / 2
    assert keys["request_goodput"] is None  # no SLO given, as vLLM writes it


def test_default_percentile_keys_by_hand():
    keys = vllm_keys(_records(), DURATION)
    # TTFT 125, 250, 375 ms: population std 125 * sqrt(2/3); p99 at rank 1.98 -> 250 + .98 * 125.
    assert keys["mean_ttft_ms"] == 250.0 and keys["median_ttft_ms"] == 250.0
    assert keys["std_ttft_ms"] == pytest.approx(125 * math.sqrt(2 / 3))
    assert keys["p99_ttft_ms"] == pytest.approx(372.5)
    # TPOT only over the two multi-token outputs.
    assert (keys["mean_tpot_ms"], keys["median_tpot_ms"], keys["std_tpot_ms"]) == (125, 125, 0)
    assert keys["p99_tpot_ms"] == 125.0
    # 12 ITLs, all 125 ms.
    assert (keys["mean_itl_ms"], keys["std_itl_ms"], keys["p99_itl_ms"]) == (125.0, 0.0, 125.0)
    # The default metrics are ttft, tpot, itl: no e2el keys, and only p99.
    assert not [k for k in keys if "e2el" in k]
    assert sorted(k for k in keys if k.startswith("p")) == [
        "p99_itl_ms",
        "p99_tpot_ms",
        "p99_ttft_ms",
    ]


def test_chosen_metrics_and_percentiles():
    keys = vllm_keys(_records(), DURATION, metrics=("e2el",), percentiles=(50.0, 99.9))
    # E2E 1250, 625, 375 ms: deviations from 750 are 500, -125, -375.
    assert keys["mean_e2el_ms"] == 750.0 and keys["median_e2el_ms"] == 625.0
    assert keys["std_e2el_ms"] == pytest.approx(math.sqrt((500**2 + 125**2 + 375**2) / 3))
    assert keys["p50_e2el_ms"] == 625.0
    assert keys["p99.9_e2el_ms"] == pytest.approx(625 + 0.998 * 625)
    assert not [k for k in keys if "ttft" in k or "itl" in k]


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"ttft": 250.0}, 2),  # r0, r1 (the boundary is inclusive)
        ({"ttft": 249.0}, 1),
        ({"e2el": 625.0}, 2),  # r1, r2
        ({"ttft": 250.0, "e2el": 625.0}, 1),  # every SLO: only r1
        ({"tpot": 100.0}, 1),  # r2: a single token has no TPOT to break it
        ({"tpot": 125.0}, 3),
        ({"ttft": 1.0}, 0),
    ],
)
def test_goodput(slos, good):
    keys = vllm_keys(_records(), DURATION, goodput=slos)
    assert keys["request_goodput"] == good / DURATION
    # tandem's own goodput counts the same requests.
    m = compute_metrics(
        _records(), DURATION, slos.get("ttft"), slos.get("tpot"), slo_e2el_ms=slos.get("e2el")
    )
    assert m.good_requests == good


def test_every_request_failed_gives_vllms_zeros():
    keys = vllm_keys([RequestRecord(0, 0.0, 0.0, 5, 5, error="x")], 1.0, goodput={"ttft": 1})
    assert keys["completed"] == 0 and keys["request_goodput"] == 0.0
    assert keys["mean_ttft_ms"] == keys["p99_ttft_ms"] == keys["std_itl_ms"] == 0.0


def test_parsers():
    assert parse_percentile_metrics("ttft, e2el") == ("ttft", "e2el")
    assert parse_metric_percentiles("25,50,99.9") == (25.0, 50.0, 99.9)
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000"]) == {
        "ttft": 500.0,
        "tpot": 50.0,
        "e2el": 2000.0,
    }
    assert (percentile_key(99.0), percentile_key(99.9), percentile_key(50)) == ("99", "99.9", "50")
    for bad in ("", "ttft,foo", "ttft,ttft"):
        with pytest.raises(ValueError):
            parse_percentile_metrics(bad)
    for bad in ("", "a", "101", "-1"):
        with pytest.raises(ValueError):
            parse_metric_percentiles(bad)
    for bad in (["ttft=5"], ["itl:5"], ["ttft:x"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def _cfg(argv: list[str]) -> BenchConfig:
    argv = ["bench", "serve", *argv]
    return config_from_args(build_parser(argv).parse_args(argv))


def test_flags():
    cfg = _cfg(
        ["--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99.9"]
        + ["--goodput", "ttft:500", "e2el:2000", "--slo-tpot-ms", "50"]
    )
    assert cfg.percentile_metric_names == ("ttft", "e2el")
    assert cfg.metric_percentile_values == (50.0, 99.9)
    assert cfg.goodput == {"ttft": 500.0, "e2el": 2000.0}
    assert cfg.slos == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    assert _cfg([]).goodput is None and _cfg([]).slos == {}
    assert _cfg(["--slo-ttft-ms", "9", "--goodput", "ttft:9"]).slos == {"ttft": 9.0}
    for bad in (
        ["--goodput", "ttft=5"],
        ["--goodput", "ttft:5", "--slo-ttft-ms", "6"],  # two different TTFT SLOs
        ["--percentile-metrics", "ttft,foo"],
        ["--metric-percentiles", "200"],
    ):
        with pytest.raises(ValueError):
            _cfg(bad)


def test_result_json_carries_both_key_sets():
    records = _records()
    cfg = BenchConfig(
        percentile_metrics="ttft,tpot,itl,e2el",
        metric_percentiles="90,99",
        goodput={"e2el": 625.0},
        slo_ttft_ms=250.0,
    )
    m = compute_metrics(records, DURATION, 250.0, slo_e2el_ms=625.0)
    data = BenchResult(cfg, m, records, "m", "now").to_dict()
    # tandem's own keys are kept...
    assert data["duration_s"] == 2.0 and data["goodput_rps"] == 0.5
    assert data["ttft_ms"]["p50"] == 250.0
    # ...beside vLLM's, which agree on what both report.
    assert data["duration"] == 2.0 and data["completed"] == 3 and data["request_goodput"] == 0.5
    assert data["output_throughput"] == 7.5 and data["p90_e2el_ms"] == pytest.approx(1125.0)
    assert data["slo"] == {"ttft_ms": 250.0, "tpot_ms": None, "e2el_ms": 625.0}
    assert "TTFT<=250ms E2EL<=625ms" in format_report(BenchResult(cfg, m, records, "m", "now"))
    json.dumps(data, allow_nan=False)


def test_a_real_run_writes_vllm_keys():
    plan = Plan(ttft_s=0.02, chunk_gap_s=0.005, failures={1: "500"})
    with StubServer(plan) as server:
        argv = ["--base-url", server.url, "--num-prompts", "4", "--input-len", "8"]
        argv += ["--output-len", "5", "--no-progress"]
        argv += ["--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99"]
        cfg = _cfg(argv + ["--goodput", "ttft:60000", "e2el:60000"])
        result = asyncio.run(run_benchmark(cfg))
    data = result.to_dict()
    ok = [r for r in result.records if r.ok]
    assert data["completed"] == len(ok) == 3
    assert data["duration"] == result.metrics.duration_s
    assert data["request_goodput"] == pytest.approx(3 / data["duration"])
    assert data["total_output_tokens"] == 15
    assert data["median_ttft_ms"] == pytest.approx(result.metrics.ttft_ms.p50)
    assert data["p99_e2el_ms"] == pytest.approx(result.metrics.e2e_ms.p99)
    assert data["mean_itl_ms"] == pytest.approx(result.metrics.itl_ms.mean)
    assert "mean_tpot_ms" not in data and "p50_itl_ms" in data
