"""The planner's signals: a real RouterServer (real HTTP, real ZMQ, fake workers) records one
window of its traffic (arrivals, lengths, local prefills, TTFT/TPOT, queue, uncached tokens),
`take_window` starts the next, and the push loop hands each window to a directory's
`report_signals` as a dict the controller can read back (through msgpack too). The recorder's
arithmetic (reservoirs, prefix counter deltas, pool state) is checked on its own below."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time

import aiohttp
import msgpack
import pytest
from router_fakes import FakeWorker, HoldingWorker

from engine.protocol import WorkerLoad
from router.directory import DOWN, DRAINING, StaticDirectory, WorkerInfo
from router.signal_recorder import (
    PrefixCounters,
    Reservoir,
    SignalRecorder,
    SignalReporter,
    pool_state,
    uncached_tokens,
)
from router.signals import WindowSignals


async def complete(s: aiohttp.ClientSession, url: str, prompt: list[int], n: int, **extra):
    body = {"prompt": prompt, "max_tokens": n, **extra}
    async with s.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json(content_type=None)


async def until(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def take(h) -> WindowSignals:
    """The router's window, taken on its own loop (where the recorder is updated)."""

    async def go() -> WindowSignals:
        return h.server.signals.take_window()

    return h.call(go())


def set_prefix(h, worker: FakeWorker, hits: int, queries: int, **load) -> None:
    extra = {"prefix_hit_tokens": hits, "prefix_query_tokens": queries}
    h.directory.set_workers([worker.info(extra=extra, **load)])
    h.call(h.server.pool.refresh())


# ---------------------------------------------------------------------------- a live router


def test_window_of_mixed_traffic_and_the_next_one_starts_empty(make_router):
    dec = FakeWorker("d0", "decode", chunk=2)
    pre = FakeWorker("p0", "prefill", partner=dec)
    h = make_router(workers=[pre, dec], disagg_threshold=8, signal_interval_s=0)
    take(h)  # whatever start-up noted is not this test's
    prompts = {(5, 6, 7): 3, tuple(range(5, 25)): 5, tuple(range(5, 45)): 1}  # prompt: tokens

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            for prompt, n in prompts.items():
                status, body = await complete(s, h.base_url, list(prompt), n)
                assert status == 200 and body["usage"]["completion_tokens"] == n

    asyncio.run(go())
    w = take(h)
    assert w.arrivals == 3 and w.finished == 3
    assert w.prompt_lengths.count == 3 and w.prompt_lengths.total == 3 + 20 + 40
    assert w.prompt_lengths.counts[2] == 1  # 3 tokens: the (2, 4] bucket
    assert w.prompt_lengths.counts[5] == 1 and w.prompt_lengths.counts[6] == 1  # 20, 40
    assert w.output_lengths.count == 3 and w.output_lengths.total == 3 + 5 + 1
    assert w.local_prefills == 1  # only the 3-token prompt is under the threshold of 8
    assert w.ttft.count == 3 and 0 < w.ttft.p50 <= w.ttft.p99 < 10
    assert w.tpot.count == 2  # a one-token answer has no time per output token
    assert w.tpot.p50 >= 0 and w.queued_requests == 0 and w.queued_prompt_tokens == 0
    assert w.uncached_prompt_tokens == 63  # the fakes report no prefix cache
    assert w.duration_s > 0 and abs(w.start_s + w.duration_s - time.time()) < 60
    nxt = take(h)
    assert (nxt.arrivals, nxt.finished, nxt.prompt_lengths.count, nxt.local_prefills) == (0,) * 4
    assert nxt.ttft.count == 0 and math.isnan(nxt.ttft.p50)
    assert nxt.start_s == pytest.approx(w.start_s + w.duration_s)
    # The same lengths reach Prometheus, in power-of-two buckets.
    text = h.call(_metrics(h))
    assert 'tandem_request_prompt_tokens_bucket{le="4.0"} 1.0' in text
    assert 'tandem_request_prompt_tokens_bucket{le="131072.0"} 3.0' in text
    assert "tandem_request_output_tokens_sum 9.0" in text
    assert "tandem_prompt_tokens_uncached_total 63.0" in text


async def _metrics(h) -> str:
    async with aiohttp.ClientSession() as s, s.get(h.base_url + "/metrics") as r:
        assert r.status == 200
        return await r.text()


def test_refused_and_failed_requests_arrive_but_do_not_finish(make_router):
    held = HoldingWorker("d0")
    h = make_router(workers=[held], max_queued_requests=1, signal_interval_s=0)
    failing = make_router(
        workers=[FakeWorker("d1", "colocated", mode="error_first")], signal_interval_s=0
    )
    take(h)

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            waiting = asyncio.create_task(complete(s, h.base_url, [5, 6, 7, 8], 2))
            await until(lambda: h.server.admission.queued_requests == 1)
            status, _ = await complete(s, h.base_url, [5] * 30, 2)
            assert status == 429  # refused before its body was read
            w = take(h)  # blocks this client loop a moment; the router runs on its own
            assert w.arrivals == 2 and w.prompt_lengths.count == 1  # the refused one: no length
            assert (w.queued_requests, w.queued_prompt_tokens) == (1, 4)
            assert w.finished == 0 and w.ttft.count == 0
            held.release()
            assert (await waiting)[0] == 200
            status, body = await complete(s, failing.base_url, [5, 6], 2)
            assert status == 500 and "boom" in body["error"]["message"]

    asyncio.run(go())
    w = take(h)
    assert (w.arrivals, w.finished, w.ttft.count, w.output_lengths.total) == (0, 1, 1, 2)
    assert w.queued_requests == 0
    f = take(failing)
    assert (f.arrivals, f.prompt_lengths.total, f.finished, f.output_lengths.count) == (1, 2, 0, 0)


def test_uncached_tokens_and_pool_state_from_the_workers_reports(make_router):
    worker = FakeWorker("d0", "colocated")
    h = make_router(workers=[worker], signal_interval_s=0)
    set_prefix(h, worker, hits=1000, queries=4000)  # history before this window: not counted
    h.server.signals.begin()

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            for _ in range(4):
                assert (await complete(s, h.base_url, list(range(5, 25)), 2))[0] == 200

    asyncio.run(go())
    # Half of the tokens the worker looked up in the window were cached: half of the 80
    # arrived tokens are uncached (the share, not 80 - 20: other routers' hits count too).
    load = {"num_running": 3, "num_waiting": 2, "num_free_blocks": 40}
    set_prefix(h, worker, hits=1020, queries=4040, **load)
    w = take(h)
    assert w.arrivals == 4 and w.uncached_prompt_tokens == 40
    assert (w.decode_running, w.decode_waiting, w.prefill_waiting) == (3, 2, 0)
    assert w.kv_usage == pytest.approx(0.6)
    # Restarted (its counters start over): what it reports now is all new.
    asyncio.run(_one(h, list(range(5, 25))))
    set_prefix(h, worker, hits=10, queries=20)
    assert take(h).uncached_prompt_tokens == 10


async def _one(h, prompt: list[int]) -> None:
    async with aiohttp.ClientSession() as s:
        assert (await complete(s, h.base_url, prompt, 2))[0] == 200


# ---------------------------------------------------------------------------- the push loop


class ReportingDirectory(StaticDirectory):
    """A directory with the controller's two planner calls; `mode` "ok", "slow" or "fail"."""

    def __init__(self, workers, status=None, mode: str = "ok") -> None:
        super().__init__(workers)
        self.reports: list[tuple[str, dict]] = []
        self.status = status
        self.mode = mode
        self.status_calls = 0

    async def report_signals(self, router_id: str, window: dict) -> None:
        self.reports.append((router_id, window))
        if self.mode == "slow":
            await asyncio.sleep(60)
        if self.mode == "fail":
            raise RuntimeError("controller is restarting")

    async def planner_status(self):
        self.status_calls += 1
        return self.status


def swap_directory(h, directory: StaticDirectory) -> None:
    """Give the harness's router `directory` (built by make_router with a StaticDirectory)."""
    h.server.directory = h.server.pool.directory = directory
    h.server.signal_reporter.directory = directory
    h.directory = directory


def test_windows_are_pushed_as_dicts_the_controller_reads_back(make_router):
    worker = FakeWorker("d0", "colocated")
    h = make_router(workers=[worker], signal_interval_s=0.1)
    directory = ReportingDirectory([worker.info()])
    swap_directory(h, directory)

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            assert (await complete(s, h.base_url, [5, 6, 7], 4))[0] == 200
        await until(lambda: sum(w["arrivals"] for _, w in directory.reports) >= 1)
        await until(lambda: len(directory.reports) >= 3)

    asyncio.run(go())
    ids = {rid for rid, _ in directory.reports}
    assert ids == {h.server.signal_reporter.router_id} and ids.pop().startswith("router-")
    windows = [WindowSignals.from_dict(d) for _, d in directory.reports]
    assert sum(w.arrivals for w in windows) == 1 and sum(w.finished for w in windows) == 1
    busy = next(d for _, d in directory.reports if d["finished"])
    # What Ray or msgpack carries comes back as the same window.
    for carried in (busy, msgpack.unpackb(msgpack.packb(busy))):
        back = WindowSignals.from_dict(carried)
        assert json.dumps(back.to_dict(), sort_keys=True) == json.dumps(busy, sort_keys=True)
    assert back.output_lengths.total == 4 and back.prompt_lengths.total == 3
    # Consecutive windows tile time: each starts where the previous one ended.
    for a, b in zip(windows, windows[1:], strict=False):
        assert b.start_s == pytest.approx(a.start_s + a.duration_s)
    assert directory.status_calls >= 3


@pytest.mark.parametrize("mode", ["slow", "fail"])
def test_a_slow_or_failing_controller_does_not_touch_serving(make_router, mode, caplog):
    worker = FakeWorker("d0", "colocated")
    h = make_router(workers=[worker], signal_interval_s=0.1)
    directory = ReportingDirectory([worker.info()], mode=mode)
    swap_directory(h, directory)
    reporter = h.server.signal_reporter
    assert reporter.timeout_s == 0.5  # the floor of the per-call timeout

    async def go() -> None:
        await until(lambda: len(directory.reports) >= 1)
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            assert (await complete(s, h.base_url, [5, 6, 7], 4))[0] == 200
            assert time.monotonic() - t0 < 5  # not behind a 60 s report
        await until(lambda: len(directory.reports) >= 3)  # the loop goes on past failures

    with caplog.at_level("WARNING", logger="router.signal_recorder"):
        asyncio.run(go())
    warnings = [r for r in caplog.records if "report_signals" in r.getMessage()]
    assert len(warnings) == 1  # logged once while it keeps failing, not every interval
    assert ("took over" if mode == "slow" else "controller is restarting") in (
        warnings[0].getMessage()
    )


def test_zero_interval_pushes_nothing(make_router):
    worker = FakeWorker("d0", "colocated")
    h = make_router(workers=[worker], signal_interval_s=0)
    directory = ReportingDirectory([worker.info()])
    swap_directory(h, directory)
    asyncio.run(_one(h, [5, 6]))
    time.sleep(0.3)
    assert directory.reports == [] and h.server.signal_reporter._task is None
    assert take(h).arrivals == 1  # still recorded; nothing takes the window but the caller


def test_reporter_tick_without_planner_calls():
    """A plain directory (no report_signals / planner_status): the window is still taken."""
    rec = SignalRecorder(lambda: [], _Queue(), clock=lambda: 10.0)
    reporter = SignalReporter(rec, StaticDirectory([]), 2.0, router_id="r1")
    rec.note_arrival([7])
    w = asyncio.run(reporter.tick())
    assert w.arrivals == 1 and reporter.planner_status is None and reporter.router_id == "r1"


# ---------------------------------------------------------------------------- the arithmetic


class _Queue:
    queued_requests = 2
    queued_prompt_tokens = 50


def _info(wid: str, role: str, state: str = "ready", incarnation: str = "a", **load) -> WorkerInfo:
    fields = (
        dict(  # noqa: C408
            num_free_blocks=50, num_total_blocks=100, num_running=1, num_waiting=1
        )
        | load
    )
    fields.setdefault("queued_prefill_tokens", 0)
    return WorkerInfo(
        wid,
        role,
        "tcp://127.0.0.1:1",
        WorkerLoad(wid, role, **fields),
        incarnation=incarnation,
        state=state,
    )


def test_reservoir_keeps_a_bounded_uniform_sample():
    r = Reservoir(100, random.Random(0))
    for i in range(10_000):
        r.add(float(i))
    assert len(r.samples) == 100 and r.seen == 10_000
    s = r.summary()
    assert s.count == 10_000  # weighted by everything seen
    assert 3000 < s.p50 < 7000 and s.p90 > s.p50  # a sample of the whole stream, not its head
    with pytest.raises(ValueError, match="capacity"):
        Reservoir(0, random.Random(0))


def test_prefix_counters_new_restarted_and_missing_workers():
    pc = PrefixCounters()
    extra = {"prefix_hit_tokens": 100, "prefix_query_tokens": 400}
    a = _info("a", "prefill", extra=extra)
    pc.prime([a])
    assert pc.advance([a]) == (0, 0)
    a2 = _info("a", "prefill", extra={"prefix_hit_tokens": 150, "prefix_query_tokens": 500})
    b = _info("b", "decode", extra={"prefix_hit_tokens": 5, "prefix_query_tokens": 10})
    assert pc.advance([a2, b]) == (55, 110)  # b joined after the baseline: all of it is new
    assert pc.advance([b]) == (0, 0)  # a missing from one snapshot ...
    assert pc.advance([a2, b]) == (0, 0)  # ... and back: not recounted
    restarted = _info("a", "prefill", extra={"prefix_hit_tokens": 7, "prefix_query_tokens": 9})
    replaced = _info(
        "b", "decode", incarnation="b2", extra={"prefix_hit_tokens": 50, "prefix_query_tokens": 60}
    )
    assert pc.advance([restarted, replaced]) == (57, 69)
    junk = _info("a", "prefill", extra={"prefix_hit_tokens": "x", "prefix_query_tokens": True})
    assert pc.advance([junk]) == (0, 0)


def test_uncached_tokens_share_and_fallback():
    assert uncached_tokens(1000, 25, 100) == 750  # a quarter of the lookups hit
    assert uncached_tokens(1000, 300, 100) == 0  # never below 0
    assert uncached_tokens(1000, 300, 0) == 700  # no query counters: the hits' increase
    assert uncached_tokens(100, 300, 0) == 0
    assert uncached_tokens(0, 0, 0) == 0


def test_pool_state_counts_ready_workers_only():
    workers = [
        _info("p0", "prefill", num_waiting=4),
        _info("p1", "prefill", state=DRAINING, num_waiting=9),
        _info("d0", "decode", num_running=3, num_waiting=1, num_free_blocks=10),
        _info("c0", "colocated", num_running=2, num_waiting=0, num_free_blocks=70),
        _info("d1", "decode", state=DOWN, num_running=50, num_free_blocks=0),
        _info("d2", "decode", num_total_blocks=0, num_free_blocks=0),
    ]
    assert pool_state(workers) == {
        "prefill_waiting": 4,
        "decode_running": 3 + 2 + 1,
        "decode_waiting": 1 + 0 + 1,
        "kv_usage": pytest.approx(0.9),
    }
    assert pool_state([])["kv_usage"] == 0.0


def test_recorder_window_on_a_test_clock():
    now = [100.0]
    workers = [_info("d0", "decode", extra={"prefix_hit_tokens": 0, "prefix_query_tokens": 0})]
    rec = SignalRecorder(lambda: workers, _Queue(), clock=lambda: now[0], max_samples=4, seed=1)
    rec.begin()
    rec.note_arrival([10, 300])
    rec.note_arrival(None)
    rec.note_route("local")
    rec.note_route("remote")
    for t in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6):
        rec.note_first_token(t)
    rec.note_finished([4, 6], 0.05)  # n = 2: two sequences
    rec.note_finished([1], None)
    workers[0] = _info("d0", "decode", extra={"prefix_hit_tokens": 31, "prefix_query_tokens": 310})
    now[0] = 102.5
    w = rec.take_window()
    assert (w.start_s, w.duration_s, w.arrivals, w.local_prefills) == (100.0, 2.5, 3, 1)
    assert w.prompt_lengths.total == 310 and w.uncached_prompt_tokens == 279
    assert (w.finished, w.output_lengths.total, w.tpot.count, w.tpot.p90) == (3, 11, 1, 0.05)
    assert w.ttft.count == 6 and (w.queued_requests, w.queued_prompt_tokens) == (2, 50)
    assert w.arrival_rate == pytest.approx(3 / 2.5)
    now[0] = 102.0  # the wall clock stepped back: still a valid (tiny) window
    assert rec.take_window().duration_s > 0


def test_routed_prompts_count_what_the_kv_index_says_their_worker_lacks():
    """Under kv-events routing the window's uncached tokens are, for the prompts it routed,
    the tokens the chosen worker lacks; the counters' share covers the rest only. The
    counters here say nothing hit (a decode worker's lookups for prompts it will READ)."""
    workers = [_info("d0", "decode", extra={"prefix_hit_tokens": 0, "prefix_query_tokens": 0})]
    rec = SignalRecorder(lambda: workers, _Queue(), clock=lambda: 100.0)
    rec.begin()
    rec.note_arrival([100, 50, 30])
    rec.note_route("remote", 100, 40)  # the prefill worker holds 60 of 100
    rec.note_route("local", 50, 0)  # the decode worker holds all 50
    workers[0] = _info("d0", "decode", extra={"prefix_hit_tokens": 0, "prefix_query_tokens": 80})
    w = rec.take_window()
    assert w.uncached_prompt_tokens == 40 + 0 + 30  # the unrouted 30 at the counters' share
    rec.note_arrival([20])
    rec.note_route("local", 20)  # affinity routing: not known, the counters decide
    assert rec.take_window().uncached_prompt_tokens == 20


def test_recorder_keeps_the_peak_one_second_prompt_tokens():
    now = [100.0]
    rec = SignalRecorder(lambda: [], _Queue(), clock=lambda: now[0])
    rec.begin()
    for t, lengths in ((100.2, [300]), (101.1, [1000, 200]), (101.9, [400]), (102.5, [100])):
        now[0] = t
        rec.note_arrival(lengths)
    now[0] = 103.0
    w = rec.take_window()
    assert w.peak_prompt_tokens_1s == 1600
    assert WindowSignals.from_dict(w.to_dict()).peak_prompt_tokens_1s == 1600
