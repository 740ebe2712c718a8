"""The controller: a named Ray actor holding the registry of workers.

Each worker registers its ZMQ request endpoint and role; the controller polls every worker's
load on a fixed period (this is also the health check: a worker that does not answer within
the timeout is marked unhealthy and left out of snapshots until it answers again). The router
reads `snapshot()` through `cluster.directory.ControllerDirectory`.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger(__name__)
CONTROLLER_NAME = "tandem-controller"
NAMESPACE = "tandem"


class Controller:
    def __init__(self, health_interval_s: float = 0.25, health_timeout_s: float = 5.0):
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.workers: dict[str, dict] = {}
        self._task: asyncio.Task | None = None

    async def register(self, info: dict, handle) -> None:
        self.workers[info["worker_id"]] = {
            **info,
            "handle": handle,
            "load": None,
            "healthy": True,
            "last_seen": time.time(),
        }
        await self._poll_one(info["worker_id"])
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._health_loop())

    async def deregister(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)

    async def snapshot(self) -> list[dict]:
        return [
            {k: v for k, v in w.items() if k != "handle"}
            for w in self.workers.values()
            if w["healthy"] and w["load"] is not None
        ]

    async def all_workers(self) -> list[dict]:
        return [{k: v for k, v in w.items() if k != "handle"} for w in self.workers.values()]

    async def _poll_one(self, worker_id: str) -> None:
        w = self.workers.get(worker_id)
        if w is None:
            return
        try:
            load = await asyncio.wait_for(w["handle"].load.remote(), self.health_timeout_s)
        except Exception as e:  # actor died, timed out, or raised
            if w["healthy"]:
                log.error("worker %s failed its health check: %s", worker_id, e)
            w["healthy"] = False
            return
        w.update(load=load, healthy=True, last_seen=time.time())

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._poll_one(wid) for wid in list(self.workers)))
            await asyncio.sleep(self.health_interval_s)
