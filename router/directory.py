"""Where the router learns its workers: a `WorkerDirectory` hands out snapshots.

The cluster layer implements `WorkerDirectory` on top of the controller actor; tests and
single-process setups use `StaticDirectory`. The router polls `snapshot()` every
`RouterConfig.refresh_interval_s` and between polls adjusts its own copy of each worker's load
on every dispatch (see `router.routing.LoadView`), so a burst spreads over the pool instead of
landing on whichever worker looked idlest at the last poll.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from engine.protocol import WorkerLoad
from engine.roles import check_role

READY, DRAINING, DOWN = "ready", "draining", "down"
WORKER_STATES = (READY, DRAINING, DOWN)


@dataclass(slots=True)
class WorkerInfo:
    """One worker as the router sees it.

    `request_endpoint` is the ZMQ endpoint the worker PULLs requests from (the router PUSHes
    there). A decode worker takes KV hand-offs from prefill workers on the same endpoint.
    `incarnation` changes when the worker is replaced (a restarted process): requests the old
    one held are lost. `state`: "ready" (routable), "draining" (finishing what it holds, no new
    requests), "down" (dead or hung: its requests are failed at once).
    `kv_events_endpoint` / `kv_snapshot_endpoint`: where it publishes its KV events and answers
    resyncs (engine/kv_events.py); empty for a worker that publishes none.
    """

    worker_id: str
    role: str  # one of engine.roles.ROLES
    request_endpoint: str
    load: WorkerLoad
    incarnation: str = ""
    state: str = READY
    kv_events_endpoint: str = ""
    kv_snapshot_endpoint: str = ""

    def __post_init__(self) -> None:
        if self.state not in WORKER_STATES:
            raise ValueError(f"state must be one of {WORKER_STATES}, got {self.state!r}")
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise ValueError("worker_id must be a non-empty string")
        check_role(self.role)
        if not isinstance(self.request_endpoint, str) or "://" not in self.request_endpoint:
            raise ValueError(
                f"request_endpoint must be a ZMQ endpoint, got {self.request_endpoint!r}"
            )
        if not isinstance(self.load, WorkerLoad):
            raise TypeError("load must be an engine.protocol.WorkerLoad")


@runtime_checkable
class WorkerDirectory(Protocol):
    async def snapshot(self) -> list[WorkerInfo]:
        """The current workers and their latest load reports."""
        ...


class StaticDirectory:
    """A fixed list of workers (tests, single-box setups); `set_workers` swaps it."""

    def __init__(self, workers: list[WorkerInfo]) -> None:
        self._workers = list(workers)

    def set_workers(self, workers: list[WorkerInfo]) -> None:
        self._workers = list(workers)

    async def snapshot(self) -> list[WorkerInfo]:
        return list(self._workers)
