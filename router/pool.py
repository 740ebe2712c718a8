"""The router's view of its workers: directory snapshots, routing, and orphaned requests.

Lifecycle: `start()` takes a first snapshot and starts a loop that takes one every
`refresh_interval_s`; `stop()` cancels it. A snapshot that fails or takes over
`SNAPSHOT_TIMEOUT_S` keeps the previous view (the controller may be restarting). Each snapshot
replaces the `LoadView` the policies read (READY workers only: a DRAINING one gets no new
request, a DOWN one nothing), drops the PUSH sockets of workers that left, and fails the
requests that depended on a worker that is lost: one the snapshot says is DOWN or that came
back as a new incarnation (at once), or one missing from two snapshots in a row (one odd
snapshot during a controller restart must not kill everything in flight). An injected
`finish_reason="abort"` TokenMessage ends them with 503 through the same path a worker's own
abort takes.

A request is `track`ed from dispatch until its `Generation` ends (`forget`). It depends on its
decode worker throughout, and on its prefill worker until the decode worker said it took the
request over (`note_handed_off`): from then on a lost prefill worker is the decode worker's
business (its READ fails, and it recomputes or fails the request by its policy).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from engine.protocol import TokenMessage
from router.config import RouterConfig
from router.dataplane import DataPlane
from router.directory import DOWN, READY, WorkerDirectory, WorkerInfo
from router.policy import LoadView, NoWorkersError, RoutePlan, plan_route

log = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 5.0


class WorkerPool:
    def __init__(
        self, config: RouterConfig, directory: WorkerDirectory, dataplane: DataPlane
    ) -> None:
        self.config = config
        self.directory = directory
        self.dataplane = dataplane
        self.workers: list[WorkerInfo] = []  # every worker of the latest snapshot
        self._view = LoadView([], config.default_block_size)
        self._refresh_task: asyncio.Task[None] | None = None
        # request id -> the (worker id, incarnation) pairs it depends on, decode first
        self._inflight: dict[str, list[tuple[str, str]]] = {}
        self._gone: set[str] = set()  # workers missing from the latest snapshot

    async def start(self) -> None:
        await self.refresh()
        self._refresh_task = asyncio.create_task(self._refresh_loop(), name="router-directory")

    async def stop(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresh_task
            self._refresh_task = None

    async def refresh(self) -> None:
        try:
            workers = await asyncio.wait_for(self.directory.snapshot(), SNAPSHOT_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - controller may be restarting; keep last view
            log.warning("worker directory snapshot failed: %s", e)
            return
        self.workers = list(workers)
        routable = [w for w in self.workers if w.state == READY]
        self._view = LoadView(routable, self.config.default_block_size)
        self.dataplane.retain({w.request_endpoint for w in self.workers if w.state != DOWN})
        self._fail_orphans({w.worker_id: w for w in self.workers})

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_interval_s)
            await self.refresh()

    def _fail_orphans(self, known: dict[str, WorkerInfo]) -> None:
        gone_now: set[str] = set()
        for rid, deps in list(self._inflight.items()):
            why = None
            for wid, incarnation in deps:
                why = self._lost(wid, incarnation, known.get(wid), gone_now)
                if why is not None:
                    break
            if why is not None:
                del self._inflight[rid]  # failed once; its Generation forgets it later
                self.dataplane.inject(
                    TokenMessage(rid, 0, [], finish_reason="abort", worker_id=wid, error=why)
                )
        self._gone = gone_now

    def _lost(
        self, wid: str, incarnation: str, info: WorkerInfo | None, gone_now: set[str]
    ) -> str | None:
        """Why a request that depends on worker `wid` (as `incarnation`) cannot finish, or
        None while it still can."""
        if info is None:
            gone_now.add(wid)
            return f"worker {wid} left the pool" if wid in self._gone else None
        if info.state == DOWN:
            return f"worker {wid} is down"
        if incarnation and info.incarnation != incarnation:
            return f"worker {wid} was restarted and lost the request"
        return None

    async def route(self, prompt_ids: list[int]) -> RoutePlan:
        """Pick the workers for one prompt and count it against them in the view.
        Raises NoWorkersError when no decode-capable worker is known, even after a refresh."""
        try:
            plan = self._plan(prompt_ids)
        except NoWorkersError:
            await self.refresh()  # workers may have registered since the last poll
            plan = self._plan(prompt_ids)
        self._view.note_dispatch(plan, len(prompt_ids))
        return plan

    def _plan(self, prompt_ids: list[int]) -> RoutePlan:
        cfg = self.config
        return plan_route(
            self._view,
            prompt_ids,
            disagg_threshold=cfg.disagg_threshold,
            prefix_tokens=cfg.affinity_prefix_tokens,
            slack_tokens=cfg.affinity_slack_tokens,
            batch_norm=cfg.decode_batch_norm,
        )

    def track(self, rid: str, plan: RoutePlan) -> None:
        self._inflight[rid] = [
            (w.worker_id, w.incarnation) for w in (plan.decode, plan.prefill) if w is not None
        ]

    def note_handed_off(self, rid: str) -> None:
        """The decode worker took `rid` over: it no longer depends on its prefill worker."""
        deps = self._inflight.get(rid)
        if deps is not None:
            del deps[1:]

    def forget(self, rid: str) -> None:
        self._inflight.pop(rid, None)

    def role_counts(self) -> dict[str, int]:
        """Routable (READY) workers per role."""
        counts: dict[str, int] = {}
        for w in self.workers:
            if w.state == READY:
                counts[w.role] = counts.get(w.role, 0) + 1
        return counts

    def state_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for w in self.workers:
            counts[w.state] = counts.get(w.state, 0) + 1
        return counts
