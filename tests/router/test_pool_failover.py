"""The router's view of lost workers (router.routing.WorkerPool over a real DataPlane): a request
fails at once when its decode worker is DOWN or came back as a new incarnation, and when its
prefill worker is lost before the decode worker took it over, but not after; a worker merely
missing from one snapshot (a controller restart) costs nothing; DRAINING workers get no new
requests and keep the ones they hold."""

from __future__ import annotations

import asyncio

import pytest

from engine.protocol import WorkerLoad
from router.config import RouterConfig
from router.dataplane import DataPlane
from router.directory import StaticDirectory, WorkerInfo
from router.routing import REMOTE, NoWorkersError, WorkerPool

LONG_PROMPT = list(range(1, 300))  # over the default disaggregation threshold: remote path


def worker(wid: str, role: str, incarnation: str = "i1", state: str = "ready") -> WorkerInfo:
    load = WorkerLoad(wid, role, 100, 100, 0, 0, 0)
    port = 5000 + sum(map(ord, wid))
    return WorkerInfo(wid, role, f"tcp://127.0.0.1:{port}", load, incarnation, state)


class Harness:
    def __init__(self) -> None:
        self.directory = StaticDirectory([worker("p", "prefill"), worker("d", "decode")])
        self.dataplane = DataPlane("127.0.0.1", 0, "127.0.0.1", 1 << 20)
        self.pool = WorkerPool(RouterConfig(model_path="m"), self.directory, self.dataplane)

    async def start(self) -> None:
        await self.dataplane.start()
        await self.pool.refresh()

    async def dispatch(self, rid: str) -> asyncio.Queue:
        plan = await self.pool.route(LONG_PROMPT)
        assert plan.path == REMOTE
        queue = self.dataplane.register(rid)
        self.pool.track(rid, plan)
        return queue

    async def snapshot(self, *workers: WorkerInfo) -> None:
        self.directory.set_workers(list(workers))
        await self.pool.refresh()


def run(test):
    async def body():
        h = Harness()
        await h.start()
        try:
            await test(h)
        finally:
            await h.dataplane.stop()

    asyncio.run(body())


def aborted(queue: asyncio.Queue) -> str | None:
    if queue.empty():
        return None
    msg = queue.get_nowait()
    assert msg.finish_reason == "abort" and msg.token_ids == []
    return msg.error


def test_a_down_decode_worker_fails_its_requests_at_once():
    async def test(h: Harness):
        q = await h.dispatch("r1")
        await h.snapshot(worker("p", "prefill"), worker("d", "decode", state="down"))
        assert "worker d is down" in aborted(q)
        assert h.pool.role_counts() == {"prefill": 1}
        with pytest.raises(NoWorkersError):
            await h.pool.route(LONG_PROMPT)

    run(test)


def test_a_new_incarnation_fails_what_the_old_one_held():
    async def test(h: Harness):
        q = await h.dispatch("r1")
        await h.snapshot(worker("p", "prefill"), worker("d", "decode", incarnation="i2"))
        assert "restarted" in aborted(q)
        q2 = await h.dispatch("r2")  # the replacement is routable at once
        await h.snapshot(worker("p", "prefill"), worker("d", "decode", incarnation="i2"))
        assert aborted(q2) is None

    run(test)


def test_a_lost_prefill_worker_matters_only_before_the_hand_off():
    async def test(h: Harness):
        before = await h.dispatch("before")
        after = await h.dispatch("after")
        h.pool.note_handed_off("after")
        await h.snapshot(worker("p", "prefill", state="down"), worker("d", "decode"))
        assert "worker p is down" in aborted(before)
        assert aborted(after) is None  # the decode worker reads or recomputes it

    run(test)


def test_missing_from_one_snapshot_is_not_lost_but_from_two_is():
    async def test(h: Harness):
        q = await h.dispatch("r1")
        await h.snapshot(worker("p", "prefill"))
        assert aborted(q) is None
        await h.snapshot(worker("p", "prefill"), worker("d", "decode"))
        assert aborted(q) is None  # it came back
        await h.snapshot(worker("p", "prefill"))
        await h.snapshot(worker("p", "prefill"))
        assert "left the pool" in aborted(q)

    run(test)


def test_a_draining_worker_keeps_its_requests_and_gets_no_new_ones():
    async def test(h: Harness):
        q = await h.dispatch("r1")
        await h.snapshot(
            worker("p", "prefill"),
            worker("d", "decode", state="draining"),
            worker("d2", "decode"),
        )
        assert aborted(q) is None
        for _ in range(5):
            assert (await h.pool.route(LONG_PROMPT)).decode.worker_id == "d2"
        assert h.pool.state_counts() == {"ready": 2, "draining": 1}

    run(test)


def test_worker_info_refuses_an_unknown_state():
    with pytest.raises(ValueError, match="state"):
        worker("x", "decode", state="zombie")
