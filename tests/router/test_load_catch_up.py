"""The router's view between load reports (router.routing.WorkerPool over a real DataPlane): a
report is up to a poll and a refresh old, so each snapshot is brought up to date with the
requests this router sent after the report was taken (counted) and ended after it (no longer
counted). Without it a conversation's next turn, sent as the last one ends, saw the worker
holding its history as still busy with that turn and went to the other one; and requests
arriving together piled onto the worker a stale report made look idle."""

from __future__ import annotations

import asyncio
import time

from engine.protocol import WorkerLoad
from router.config import RouterConfig
from router.dataplane import DataPlane
from router.directory import StaticDirectory, WorkerInfo
from router.routing import REMOTE, WorkerPool

PROMPT = list(range(1, 41))  # 40 tokens: 3 blocks of 16


def worker(wid: str, role: str, at: float | None, running: int = 0, free: int = 100) -> WorkerInfo:
    extra = {"block_size": 16} | ({} if at is None else {"time": at})
    load = WorkerLoad(wid, role, free, 100, running, 0, 0, extra=extra)
    return WorkerInfo(wid, role, f"tcp://127.0.0.1:{5000 + sum(map(ord, wid))}", load)


def run(test, disagg_threshold: int = 10_000):
    async def body():
        directory = StaticDirectory([])
        dataplane = DataPlane("127.0.0.1", 0, "127.0.0.1", 1 << 20)
        config = RouterConfig(model_path="m", disagg_threshold=disagg_threshold)
        pool = WorkerPool(config, directory, dataplane)
        await dataplane.start()

        async def snapshot(*workers: WorkerInfo) -> None:
            directory.set_workers(list(workers))
            await pool.refresh()

        async def route(rid: str):
            plan = await pool.route(PROMPT)
            pool.track(rid, plan)
            return plan

        try:
            await test(pool, snapshot, route)
        finally:
            await dataplane.stop()

    asyncio.run(body())


def test_a_report_taken_before_a_request_ended_no_longer_counts_it():
    async def test(pool, snapshot, route):
        before = time.time() - 1.0
        await snapshot(worker("d0", "decode", before), worker("d1", "decode", before))
        assert (await route("turn-1")).decode.worker_id == "d0"  # a tie: the first id
        taken = time.time()  # d0's report, taken while turn 1 ran: it counts it
        busy = (worker("d0", "decode", taken, running=1, free=97), worker("d1", "decode", taken))
        await snapshot(*busy)
        assert (await route("other")).decode.worker_id == "d1"  # d0 really is busier
        pool.forget("other")
        pool.forget("turn-1")  # ended after d0's report
        await snapshot(*busy)  # the same report again: turn 1 is taken off it
        assert (await route("turn-2")).decode.worker_id == "d0"
        pool.forget("turn-2")
        # A report without its time cannot be corrected: taken as it stands.
        await snapshot(worker("d0", "decode", None, running=1, free=97), busy[1])
        assert (await route("turn-3")).decode.worker_id == "d1"

    run(test)


def test_a_report_taken_before_a_request_was_sent_counts_it_from_the_router():
    async def test(pool, snapshot, route):
        stale = time.time() - 1.0
        workers = [worker(w, r, stale) for w, r in (("d0", "decode"), ("d1", "decode"))]
        workers += [worker(w, "prefill", stale) for w in ("p0", "p1")]
        await snapshot(*workers)
        first = await route("a")
        assert first.path == REMOTE
        assert (first.decode.worker_id, first.prefill.worker_id) == ("d0", "p0")
        await snapshot(*workers)  # reports from before "a" was sent: it is added back
        second = await route("b")
        assert (second.decode.worker_id, second.prefill.worker_id) == ("d1", "p1")
        # "a" handed off: p0 is free again (p1 still prefills "b"); d0 and d1 decode one each.
        pool.note_handed_off("a")
        await snapshot(*workers)
        third = await route("c")
        assert (third.decode.worker_id, third.prefill.worker_id) == ("d0", "p0")
        await snapshot(*workers)
        assert (await route("e")).decode.worker_id == "d1"  # d0 now decodes two
        pool.forget("e")
        # Everything ended: the stale reports stand as they are.
        for rid in ("a", "b", "c"):
            pool.forget(rid)
        await snapshot(*workers)
        last = await route("d")
        assert (last.decode.worker_id, last.prefill.worker_id) == ("d0", "p0")

    run(test, disagg_threshold=8)


def test_ended_requests_are_kept_only_while_a_report_may_predate_their_end(monkeypatch):
    import router.routing as routing

    async def test(pool, snapshot, route):
        at = time.time()
        await snapshot(worker("d0", "decode", at))
        for i in range(50):
            await route(f"r{i}")
        for i in range(49):
            pool.forget(f"r{i}")
        await snapshot(worker("d0", "decode", at))
        assert len(pool._routed) == 50  # within ROUTED_KEEP_S: still correcting reports
        monkeypatch.setattr(routing, "ROUTED_KEEP_S", -1.0)
        pool.directory.snapshot = None  # a failing snapshot (controller away) still prunes
        await pool.refresh()
        assert list(pool._routed) == ["r49"]  # the one still running stays

    run(test)
