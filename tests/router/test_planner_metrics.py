"""The planner's metrics in the router's /metrics: the controller's status dict checked into a
`PlannerStatus` and exported by `PlannerCollector` (desired / ready / starting / draining
replicas per pool, cumulative decisions, predicted vs observed), nothing but
`tandem_planner_enabled 0` when autoscaling is off, and a malformed status dropped with a
warning while /metrics stays 200. Read through prometheus_client's text parser, as
Prometheus scrapes it."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from router_fakes import FakeWorker

from router.directory import StaticDirectory
from router.metrics import LENGTH_BUCKETS, RouterMetrics
from router.planner_status import PlannerStatus
from router.signals import LENGTH_EDGES

STATUS = {
    "enabled": True,
    "interval_s": 10.0,
    "desired": {"prefill": 2, "decode": 1},
    "replicas": {"prefill": 1, "decode": 1},
    "starting": {"prefill": 1, "decode": 0},
    "draining": {"prefill": 0, "decode": 0},
    "decisions": [["prefill", "up", "demand", 3], ["decode", "hold", "steady", 7]],
    "predicted": {"prefill_tokens_per_s": 1.0, "ttft_p90_s": 0.2},
    "observed": {"prefill_tokens_per_s": 1.1, "ttft_p90_s": 0.25},
    "last_reasons": {"prefill": "demand 1.8 workers", "decode": "steady"},
    "config": {"slo_ttft_ms": 1000, "gpu_budget": None},  # a key the router does not read
}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(status: PlannerStatus | None) -> dict[tuple[str, tuple], float]:
    m = RouterMetrics(lambda: [])
    m.track_planner(lambda: status)
    return samples(generate_latest(m.registry).decode())


def planner_names(s: dict) -> set[str]:
    return {name for name, _ in s if name.startswith("tandem_planner")}


def test_status_is_exported_per_pool_direction_reason_and_quantity():
    s = scrape(PlannerStatus.from_dict(STATUS))
    assert s[("tandem_planner_enabled", ())] == 1
    assert s[("tandem_planner_interval_seconds", ())] == 10
    for name, values in (
        ("tandem_planner_desired_replicas", STATUS["desired"]),
        ("tandem_planner_replicas", STATUS["replicas"]),
        ("tandem_planner_replicas_starting", STATUS["starting"]),
        ("tandem_planner_replicas_draining", STATUS["draining"]),
    ):
        for pool, n in values.items():
            assert s[(name, (("pool", pool),))] == n, (name, pool)
    assert s[("tandem_planner_decisions_total", _d("prefill", "up", "demand"))] == 3
    assert s[("tandem_planner_decisions_total", _d("decode", "hold", "steady"))] == 7
    for kind in ("predicted", "observed"):
        for quantity, value in STATUS[kind].items():
            assert s[(f"tandem_planner_{kind}", (("quantity", quantity),))] == value


def _d(pool: str, direction: str, reason: str) -> tuple:
    return (("direction", direction), ("pool", pool), ("reason", reason))


def test_autoscaling_off_exports_only_enabled_zero():
    for off in (None, {"enabled": False}, {"enabled": False, "desired": "ignored"}):
        assert PlannerStatus.from_dict(off) is None
        s = scrape(PlannerStatus.from_dict(off))
        assert planner_names(s) == {"tandem_planner_enabled"}
        assert s[("tandem_planner_enabled", ())] == 0


def test_repeated_decision_rows_add_up_to_one_series():
    status = PlannerStatus.from_dict(
        {
            "enabled": True,
            "decisions": [("decode", "up", "backlog", 1), ["decode", "up", "backlog", 2]],
        }
    )
    assert status is not None and status.decisions == (("decode", "up", "backlog", 3.0),)
    assert status.interval_s is None and status.desired == {}
    s = scrape(status)
    assert s[("tandem_planner_decisions_total", _d("decode", "up", "backlog"))] == 3
    assert "tandem_planner_interval_seconds" not in planner_names(s)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"enabled": "yes"}, "enabled"),
        ({"desired": {"prefill": -1}}, "desired"),
        ({"replicas": {"decode": 1.5}}, "replicas"),
        ({"starting": {"decode": True}}, "starting"),
        ({"draining": ["prefill"]}, "draining"),
        ({"decisions": [["prefill", "up", "demand"]]}, "decision"),
        ({"decisions": [["prefill", "up", "", 1]]}, "decision"),
        ({"decisions": [["prefill", "up", "demand", -2]]}, "decision count"),
        ({"decisions": "up"}, "decisions"),
        ({"predicted": {"ttft_p90_s": "fast"}}, "predicted"),
        ({"observed": {"": 1.0}}, "observed"),
        ({"interval_s": 0}, "interval_s"),
        ({"last_reasons": {"prefill": 3}}, "last_reasons"),
    ],
)
def test_a_malformed_status_is_refused_naming_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        PlannerStatus.from_dict(STATUS | change)


def test_a_status_that_is_not_a_dict_is_refused():
    with pytest.raises(ValueError, match="must be a dict"):
        PlannerStatus.from_dict(["enabled"])


def test_length_histograms_and_uncached_counter_exist_with_power_of_two_buckets():
    assert LENGTH_BUCKETS == tuple(float(e) for e in LENGTH_EDGES) and LENGTH_BUCKETS[0] == 1
    assert 128 * 1024 in LENGTH_BUCKETS and all(
        b == 2 * a for a, b in zip(LENGTH_BUCKETS, LENGTH_BUCKETS[1:], strict=False)
    )
    m = RouterMetrics(lambda: [])
    m.request_prompt_tokens.observe(3000)
    m.request_output_tokens.observe(1)
    m.prompt_tokens_uncached.inc(5)
    s = samples(generate_latest(m.registry).decode())
    assert s[("tandem_request_prompt_tokens_bucket", (("le", "2048.0"),))] == 0
    assert s[("tandem_request_prompt_tokens_bucket", (("le", "4096.0"),))] == 1
    assert s[("tandem_request_output_tokens_bucket", (("le", "1.0"),))] == 1
    assert s[("tandem_request_output_tokens_count", ())] == 1
    assert s[("tandem_prompt_tokens_uncached_total", ())] == 5
    # The existing names are still there beside them.
    assert ("tandem_prompt_tokens_total", ()) in s and ("tandem_planner_enabled", ()) in s


# ---------------------------------------------------------------------------- a live router


class StatusDirectory(StaticDirectory):
    def __init__(self, workers, status) -> None:
        super().__init__(workers)
        self.status = status
        self.calls = 0

    async def planner_status(self):
        self.calls += 1
        return self.status


async def scrape_router(h) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.get(h.base_url + "/metrics") as r:
        return r.status, samples(await r.text())


def test_router_exports_the_fetched_status_and_survives_a_bad_one(make_router, caplog):
    worker = FakeWorker("d0", "colocated")
    h = make_router(workers=[worker], signal_interval_s=0.1)
    directory = StatusDirectory([worker.info()], STATUS)
    h.server.signal_reporter.directory = directory

    def wait_calls(n: int) -> None:
        end = time.monotonic() + 10
        start = directory.calls
        while directory.calls < start + n and time.monotonic() < end:
            time.sleep(0.02)
        assert directory.calls >= start + n

    wait_calls(2)
    status, s = asyncio.run(scrape_router(h))
    assert status == 200 and s[("tandem_planner_enabled", ())] == 1
    assert s[("tandem_planner_desired_replicas", (("pool", "prefill"),))] == 2
    with caplog.at_level("WARNING", logger="router.signal_recorder"):
        directory.status = STATUS | {"desired": {"prefill": "two"}}
        wait_calls(3)
    status, s = asyncio.run(scrape_router(h))
    assert status == 200  # a bad status never breaks the scrape
    assert planner_names(s) == {"tandem_planner_enabled"} and s[("tandem_planner_enabled", ())] == 0
    bad = [r for r in caplog.records if "bad planner status" in r.getMessage()]
    assert len(bad) == 1 and "desired" in bad[0].getMessage()  # once, not every interval
    directory.status = {"enabled": False}
    wait_calls(2)
    assert planner_names(asyncio.run(scrape_router(h))[1]) == {"tandem_planner_enabled"}
    directory.status = STATUS
    wait_calls(2)
    assert asyncio.run(scrape_router(h))[1][("tandem_planner_enabled", ())] == 1


class FlakyDirectory(StaticDirectory):
    def __init__(self) -> None:
        super().__init__([])
        self.fail = False

    async def planner_status(self):
        if self.fail:
            raise ConnectionError("controller gone")
        return STATUS


def test_last_good_status_outlives_a_blip_but_not_an_outage():
    from router.signal_recorder import STALE_STATUS_MISSES, SignalRecorder, SignalReporter

    class Queue:
        queued_requests = queued_prompt_tokens = 0

    directory = FlakyDirectory()
    reporter = SignalReporter(SignalRecorder(lambda: [], Queue()), directory, 1.0)

    async def ticks(n: int) -> None:
        for _ in range(n):
            await reporter.tick()

    asyncio.run(ticks(1))
    assert reporter.planner_status == PlannerStatus.from_dict(STATUS)
    directory.fail = True
    asyncio.run(ticks(STALE_STATUS_MISSES - 1))
    assert reporter.planner_status is not None  # a blip: still the last good one
    asyncio.run(ticks(1))
    assert reporter.planner_status is None
    directory.fail = False
    asyncio.run(ticks(1))
    assert reporter.planner_status is not None
