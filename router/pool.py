"""The router's view of its workers: directory snapshots, routing, and orphaned requests.

Lifecycle: `start()` takes a first snapshot and starts a loop that takes one every
`refresh_interval_s`; `stop()` cancels it. A snapshot that fails or takes over
`SNAPSHOT_TIMEOUT_S` keeps the previous view (the controller may be restarting). Each snapshot
replaces the `LoadView` the policies read, drops the PUSH sockets of workers that left, and
fails the requests of a worker missing from two snapshots in a row (one odd snapshot during a
controller restart must not kill everything in flight): an injected `finish_reason="abort"`
TokenMessage ends them with 503 through the same path a worker's own abort takes.

A request is `track`ed from dispatch until its `Generation` ends (`forget`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from engine.protocol import TokenMessage
from router.config import RouterConfig
from router.dataplane import DataPlane
from router.directory import WorkerDirectory, WorkerInfo
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
        self.workers: list[WorkerInfo] = []
        self._view = LoadView([], config.default_block_size)
        self._refresh_task: asyncio.Task[None] | None = None
        self._inflight: dict[str, tuple[str, ...]] = {}  # request id -> worker ids involved
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
        self._view = LoadView(self.workers, self.config.default_block_size)
        self.dataplane.retain({w.request_endpoint for w in self.workers})
        self._fail_orphans({w.worker_id for w in self.workers})

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_interval_s)
            await self.refresh()

    def _fail_orphans(self, live: set[str]) -> None:
        gone_now: set[str] = set()
        for rid, worker_ids in list(self._inflight.items()):
            missing = [w for w in worker_ids if w not in live]
            gone_now.update(missing)
            confirmed = [w for w in missing if w in self._gone]
            if confirmed:
                self.dataplane.inject(
                    TokenMessage(
                        rid,
                        0,
                        [],
                        finish_reason="abort",
                        worker_id=confirmed[0],
                        error=f"worker {confirmed[0]} left the pool",
                    )
                )
        self._gone = gone_now

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
        self._inflight[rid] = tuple(
            w.worker_id for w in (plan.decode, plan.prefill) if w is not None
        )

    def forget(self, rid: str) -> None:
        self._inflight.pop(rid, None)

    def role_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for w in self.workers:
            counts[w.role] = counts.get(w.role, 0) + 1
        return counts
