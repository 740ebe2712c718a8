"""`WorkerDirectory` for the router, backed by the controller actor."""

from __future__ import annotations

from engine.protocol import WorkerLoad
from router.directory import WorkerInfo


class ControllerDirectory:
    def __init__(self, controller):
        self.controller = controller

    async def snapshot(self) -> list[WorkerInfo]:
        rows = await self.controller.snapshot.remote()
        return [
            WorkerInfo(
                worker_id=r["worker_id"],
                role=r["role"],
                request_endpoint=r["request_endpoint"],
                load=WorkerLoad(**r["load"]),
            )
            for r in rows
        ]
