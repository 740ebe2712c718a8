"""The router's SLO metrics: every request served to its end is counted in
`tandem_slo_requests{result}` by engine/slo.py's rule (the one the planner sizes for, the
simulator's attainment and `tandem bench serve`'s goodput use): TTFT against the base target
plus its allowance per 1k prompt tokens, TPOT against its own; a request taken and not served
counts as failed (5xx after admission) or refused (429/503). Through the real router (aiohttp,
real HTTP, real ZMQ) with test-seam workers whose token pace is set."""

from __future__ import annotations

import math
import re

import pytest
import requests
from router_fakes import FakeWorker

from engine.slo import SLO_RESULTS, SLO_UNSERVED, SloTargets, ttft_target
from router.config import RouterConfig

BODY = {"model": "tiny-llama", "prompt": "hi there", "ignore_eos": True}
# A base TTFT target no router can meet (1 microsecond), so a met TTFT is the allowance's doing.
UNMEETABLE_MS = 0.001


def _slo_counts(base_url: str) -> dict[str, float]:
    text = requests.get(base_url + "/metrics", timeout=20).text
    found = dict(re.findall(r'^tandem_slo_requests_total\{result="(\w+)"\} (\S+)$', text, re.M))
    return {k: float(v) for k, v in found.items()}


def _serve(h, max_tokens: int, stream: bool = False) -> None:
    body = BODY | {"max_tokens": max_tokens, "stream": stream}
    r = requests.post(h.base_url + "/v1/completions", json=body, timeout=20)
    assert r.status_code == 200, r.text


def test_a_request_is_judged_by_ttft_and_tpot(make_router):
    # Tokens 0.25 s apart: TPOT 250 ms against a 100 ms target; TTFT against 1 us.
    slow = FakeWorker("d0", "colocated", delay_s=0.25)
    h = make_router([slow], slo_ttft_ms=UNMEETABLE_MS, slo_tpot_ms=100.0)
    assert _slo_counts(h.base_url) == dict.fromkeys((*SLO_RESULTS, *SLO_UNSERVED), 0.0)
    _serve(h, max_tokens=1)  # one token: no TPOT to miss
    _serve(h, max_tokens=3, stream=True)
    assert _slo_counts(h.base_url) == {
        "met": 0.0,
        "missed_ttft": 1.0,
        "missed_tpot": 0.0,
        "missed_both": 1.0,
        "failed": 0.0,
        "refused": 0.0,
    }
    text = requests.get(h.base_url + "/metrics", timeout=20).text
    assert 'tandem_slo_target_seconds{target="tpot"} 0.1' in text
    assert 'tandem_slo_target_seconds{target="ttft"} 1e-06' in text


def test_the_ttft_target_grows_with_the_prompt(make_router):
    # 1e6 ms per 1k prompt tokens: even a one-token prompt gets 1,000 s, so the unmeetable
    # base is met. Without the allowance every request below would miss its TTFT.
    fast = FakeWorker("d0", "colocated")
    h = make_router([fast], slo_ttft_ms=UNMEETABLE_MS, slo_ttft_ms_per_1k=1e6, slo_tpot_ms=1e4)
    _serve(h, max_tokens=1)
    _serve(h, max_tokens=4)
    _serve(h, max_tokens=4, stream=True)
    assert _slo_counts(h.base_url) == {
        "met": 3.0,
        "missed_ttft": 0.0,
        "missed_tpot": 0.0,
        "missed_both": 0.0,
        "failed": 0.0,
        "refused": 0.0,
    }


def test_a_tpot_miss_alone(make_router):
    slow = FakeWorker("d0", "colocated", delay_s=0.25)
    h = make_router([slow], slo_ttft_ms=60_000.0, slo_tpot_ms=100.0)
    _serve(h, max_tokens=3)
    assert _slo_counts(h.base_url)["missed_tpot"] == 1.0


def test_a_request_not_served_misses_too(make_router):
    # A worker that fails before any token: a 5xx after admission, counted "failed".
    h = make_router([FakeWorker("d0", "colocated", mode="error_first")], slo_ttft_ms=1000.0)
    r = requests.post(h.base_url + "/v1/completions", json=BODY | {"max_tokens": 2}, timeout=20)
    assert r.status_code >= 500
    # No worker at all: 503 no_workers, a refusal like 429 queue_full and 503 draining.
    empty = make_router([], slo_ttft_ms=1000.0)
    r = requests.post(empty.base_url + "/v1/completions", json=BODY | {"max_tokens": 2}, timeout=20)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers"
    assert _slo_counts(h.base_url)["failed"] == 1.0 and _slo_counts(h.base_url)["met"] == 0.0
    assert _slo_counts(empty.base_url)["refused"] == 1.0
    # A 4xx is the client's: no SLO count.
    bad = requests.post(empty.base_url + "/v1/completions", json={"prompt": 1}, timeout=20)
    assert bad.status_code == 400
    assert sum(_slo_counts(empty.base_url).values()) == 1.0


def test_no_targets_no_slo_metric(make_router):
    h = make_router()
    _serve(h, max_tokens=2)
    text = requests.get(h.base_url + "/metrics", timeout=20).text
    assert "tandem_slo_requests" not in text and "tandem_slo_target_seconds" not in text
    assert "tandem_ttft_seconds_count 1.0" in text  # the request was measured all the same


def test_the_rule():
    t = SloTargets(ttft_ms=1000.0, ttft_ms_per_1k=250.0, tpot_ms=50.0)
    assert ttft_target(1000.0, 250.0, 20_000) == 6000.0
    assert t.judge(20_000, 5.9, 0.05) == "met"  # 6 s for a 20k-token prompt
    assert t.judge(100, 5.9, 0.05) == "missed_ttft"  # 1.025 s for 100 tokens
    assert t.judge(100, 0.5, 0.051) == "missed_tpot"
    assert t.judge(100, 2.0, 0.2) == "missed_both"
    assert t.judge(100, 0.5, None) == "met"  # a one-token answer has no TPOT
    assert SloTargets(tpot_ms=50.0).judge(10**6, 1e9, 0.01) == "met"  # TTFT not judged
    assert not SloTargets().judged and SloTargets(tpot_ms=1.0).judged


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"slo_ttft_ms": 0.0}, "slo_ttft_ms"),
        ({"slo_ttft_ms": -5.0}, "slo_ttft_ms"),
        ({"slo_tpot_ms": math.inf}, "slo_tpot_ms"),
        ({"slo_tpot_ms": math.nan}, "slo_tpot_ms"),
        ({"slo_tpot_ms": True}, "slo_tpot_ms"),
        ({"slo_ttft_ms_per_1k": -1.0}, "slo_ttft_ms_per_1k"),
        ({"slo_ttft_ms": "1000"}, "slo_ttft_ms"),
    ],
)
def test_a_bad_target_is_refused_by_name(kwargs, named):
    with pytest.raises(ValueError, match=named):
        RouterConfig(model_path="m", **kwargs)
