"""The metric names and labels other code relies on: the router's generation code calls
`metrics.finished.labels(finish_reason=...)`, and the Helm chart's vLLM-compatible recording
rules and dashboard read the per-worker series by name (tests/deploy/test_helm_metrics.py)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.protocol import WorkerLoad
from router.directory import WorkerInfo
from router.metrics import FINISH_REASONS, RouterMetrics


def _worker(worker_id: str, role: str, **load) -> WorkerInfo:
    fields = {
        "num_free_blocks": 25,
        "num_total_blocks": 100,
        "num_running": 3,
        "num_waiting": 2,
        "queued_prefill_tokens": 40,
        "extra": {"prefix_hit_tokens": 30, "prefix_query_tokens": 120, "transfer_bytes": 7},
    } | load
    return WorkerInfo(worker_id, role, "tcp://127.0.0.1:1", WorkerLoad(worker_id, role, **fields))


def _samples(metrics: RouterMetrics) -> dict[tuple[str, tuple], float]:
    """Every sample of the text exposition (what Prometheus scrapes), by (name, labels)."""
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_finished_counter_has_the_finish_reason_label():
    m = RouterMetrics(lambda: [])
    # Every reason is exported at 0 before the first request ends.
    before = _samples(m)
    for reason in ("stop", "length", "abort", "error"):
        assert before[("tandem_requests_finished_total", (("finish_reason", reason),))] == 0
    assert set(FINISH_REASONS) == {"stop", "length", "abort", "error"}
    m.finished.labels(finish_reason="stop").inc()
    m.finished.labels(finish_reason="length").inc(2)
    after = _samples(m)
    assert after[("tandem_requests_finished_total", (("finish_reason", "stop"),))] == 1
    assert after[("tandem_requests_finished_total", (("finish_reason", "length"),))] == 2
    with pytest.raises(ValueError):
        m.finished.labels(reason="stop")  # the label is finish_reason, nothing else


def test_per_worker_gauges_and_prefix_counters():
    workers = [
        _worker("p0", "prefill"),
        _worker("d0", "decode", num_free_blocks=100, num_running=5, num_waiting=0, extra={}),
    ]
    s = _samples(RouterMetrics(lambda: workers))
    p0 = (("role", "prefill"), ("worker", "p0"))
    d0 = (("role", "decode"), ("worker", "d0"))
    assert s[("tandem_running_requests", p0)] == 3 and s[("tandem_running_requests", d0)] == 5
    assert s[("tandem_queue_depth", p0)] == 2 and s[("tandem_queue_depth", d0)] == 0
    assert s[("tandem_kv_usage_ratio", p0)] == pytest.approx(0.75)
    assert s[("tandem_kv_usage_ratio", d0)] == 0.0
    assert s[("tandem_prefix_cache_query_tokens_total", p0)] == 120
    assert s[("tandem_prefix_cache_hit_tokens_total", p0)] == 30
    # A worker that does not report a counter has no series for it (not a made-up 0).
    assert ("tandem_prefix_cache_query_tokens_total", d0) not in s


def test_a_down_worker_has_no_load_gauges_but_keeps_its_counters():
    """Its last report describes a process that is gone: its blocks were not leaked (a leak
    check summing free vs total blocks saw a killed worker's leased blocks as leaked while its
    replacement was still starting), and it runs nothing. What it did stays counted."""
    dead = _worker("p0", "prefill", num_free_blocks=93)
    dead.state = "down"
    s = _samples(RouterMetrics(lambda: [dead, _worker("d0", "decode")]))
    p0 = (("role", "prefill"), ("worker", "p0"))
    for gauge in ("tandem_kv_free_blocks", "tandem_kv_total_blocks", "tandem_running_requests"):
        assert (gauge, p0) not in s
        assert (gauge, (("role", "decode"), ("worker", "d0"))) in s
    assert s[("tandem_prefix_cache_hit_tokens_total", p0)] == 30
    assert s[("tandem_workers", (("role", "prefill"), ("state", "down")))] == 1


def test_kv_usage_of_a_worker_without_blocks_is_zero():
    s = _samples(RouterMetrics(lambda: [_worker("c0", "colocated", num_total_blocks=0)]))
    assert s[("tandem_kv_usage_ratio", (("role", "colocated"), ("worker", "c0")))] == 0.0


def test_bad_counter_values_are_skipped():
    extra = {"prefix_query_tokens": True, "prefix_hit_tokens": "12"}
    s = _samples(RouterMetrics(lambda: [_worker("d1", "decode", extra=extra)]))
    assert not any(name.startswith("tandem_prefix_cache") for name, _ in s)


def test_host_kv_tier_counters_and_occupancy():
    """A worker with the host KV tier on (engine/kv_host_cache.py) exports its counters and its
    occupancy; one without it has no such series."""
    host = {
        "host_hit_tokens": 64,
        "host_hit_blocks": 4,
        "host_miss_blocks": 2,
        "host_demotions": 9,
        "host_promotions": 4,
        "host_dropped": 0,
        "host_bytes_demoted": 900,
        "host_bytes_promoted": 400,
        "host_used_blocks": 9,
        "host_total_blocks": 32,
    }
    workers = [_worker("p0", "prefill", extra=host), _worker("d0", "decode", extra={})]
    s = _samples(RouterMetrics(lambda: workers))
    p0 = (("role", "prefill"), ("worker", "p0"))
    assert s[("tandem_kv_host_hit_tokens_total", p0)] == 64
    assert s[("tandem_kv_host_miss_blocks_total", p0)] == 2
    assert s[("tandem_kv_host_promotions_total", p0)] == 4
    assert s[("tandem_kv_host_demoted_bytes_total", p0)] == 900
    assert (s[("tandem_kv_host_used_blocks", p0)], s[("tandem_kv_host_total_blocks", p0)]) == (
        9,
        32,
    )
    assert not any(name.startswith("tandem_kv_host") and lv[1][1] == "d0" for name, lv in s)
