"""Where the router learns its workers: a `WorkerDirectory` hands out snapshots.

The cluster layer implements `WorkerDirectory` on top of the controller actor; tests and
single-process setups use `StaticDirectory`. The router polls `snapshot()` every
`RouterConfig.refresh_interval_s` and between polls adjusts its own copy of each worker's load
on every dispatch (see `router.policy.LoadView`), so a burst spreads over the pool instead of
landing on whichever worker looked idlest at the last poll.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from engine.protocol import WorkerLoad

ROLES = ("prefill", "decode", "colocated")


@dataclass(slots=True)
class WorkerInfo:
    """One worker as the router sees it.

    `request_endpoint` is the ZMQ endpoint the worker PULLs requests from (the router PUSHes
    there). `handoff_endpoint` is where a prefill worker should send the KV hand-off for
    requests decoded by this worker; empty means "same as request_endpoint".
    """

    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    request_endpoint: str
    load: WorkerLoad
    handoff_endpoint: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise ValueError("worker_id must be a non-empty string")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.request_endpoint, str) or "://" not in self.request_endpoint:
            raise ValueError(
                f"request_endpoint must be a ZMQ endpoint, got {self.request_endpoint!r}"
            )
        if not isinstance(self.load, WorkerLoad):
            raise TypeError("load must be an engine.protocol.WorkerLoad")

    @property
    def decode_endpoint(self) -> str:
        return self.handoff_endpoint or self.request_endpoint


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
