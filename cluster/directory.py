"""`WorkerDirectory` for the router, backed by the controller actor.

Beyond `snapshot()`, the router's signal loop (router/signal_recorder.py) calls
`report_signals` (one planner window of its traffic, a `router.signals.WindowSignals` as a
dict) and `planner_status` (the planner's state for the router's /metrics) every
`signal_interval_s`; both are plain actor calls, timed out and logged by the router."""

from __future__ import annotations

from engine.protocol import WorkerLoad
from router.directory import WorkerInfo

# WorkerLoad's own fields; the controller's load rows carry more (the incarnation).
_LOAD_FIELDS = frozenset(WorkerLoad.__dataclass_fields__)


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
                load=_load(r),
                incarnation=r.get("incarnation", ""),
                state=r.get("state", "ready"),
                kv_events_endpoint=r.get("kv_events_endpoint", ""),
                kv_snapshot_endpoint=r.get("kv_snapshot_endpoint", ""),
            )
            for r in rows
        ]

    async def report_signals(self, router_id: str, window: dict) -> None:
        await self.controller.report_signals.remote(router_id, window)

    async def planner_status(self) -> dict | None:
        return await self.controller.planner_status.remote()


def _load(row: dict) -> WorkerLoad:
    """The worker's last load report (a DOWN worker that never reported: an empty one)."""
    load = row.get("load")
    if load is None:
        return WorkerLoad(row["worker_id"], row["role"], 0, 0, 0, 0, 0)
    return WorkerLoad(**{k: v for k, v in load.items() if k in _LOAD_FIELDS})
