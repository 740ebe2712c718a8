"""Fault injection for the KV transfer path: a `FaultPlan` and the receiver hooks it installs.

Lifecycle: a plan is given once, at construction (`KVTransferAgent(..., faults=FaultPlan(...))`
or its dict form, which travels in msgpack/JSON), and never changes. An empty plan, the
default, installs nothing: the receiver calls `NixlEndpoint`'s own post/check/release and the
side channel hands renewals straight to the lease table, so no path tests a fault flag per
READ or per block. A plan with a receiver knob wraps those three NIXL calls in `ReadFaults`
(one per agent, used only under the agent's API lock); `drop_renew_replies` swaps the side
channel's renewal handler.

Knobs, each taking the real code path of the failure it imitates:

    read_delay_s        receiver: every READ is held back this long before it is posted. The
                        read is TRANSFERRING meanwhile, its lease pinned and renewed, and
                        read_timeout_s and peer liveness apply as to a READ in flight: kill the
                        sender in that window and the READ meets a dead peer.
    fail_reads          receiver: the first N READ posts fail as if NIXL returned an error; the
                        read ends ReadFailed with a reason naming the injected error, its handle
                        released, the sender told to free its blocks. The next READ is real.
    never_read          receiver: start_read is accepted, but no READ is posted and no renewal
                        is sent, so the sender's lease expires (Released lease_expired); the
                        receiver's own read_timeout_s ends the read as ReadFailed.
    drop_renew_replies  sender: renewals are applied (leases pinned, extended) but never
                        answered, like a sender whose side channel hung; its readers declare it
                        down after peer_timeout_s.

With fail_reads and a delay (or never_read) both set, the first N posts fail at once and the
later ones are held back.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    from kv_transfer.nixl import NixlEndpoint

INJECTED = "injected fault"  # every injected failure's reason contains this
MAX_READ_DELAY_S = 3600.0


@dataclass(slots=True, frozen=True)
class FaultPlan:
    """Which faults an agent injects; the default injects none."""

    read_delay_s: float = 0.0
    fail_reads: int = 0
    never_read: bool = False
    drop_renew_replies: bool = False

    def __post_init__(self) -> None:
        d = self.read_delay_s
        if isinstance(d, bool) or not isinstance(d, int | float) or not math.isfinite(d):
            raise ValueError(f"read_delay_s must be a finite number, got {d!r:.80}")
        if not 0 <= d <= MAX_READ_DELAY_S:
            raise ValueError(f"read_delay_s must be in [0, {MAX_READ_DELAY_S}], got {d}")
        n = self.fail_reads
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < 1 << 31:
            raise ValueError(f"fail_reads must be a non-negative int, got {n!r:.80}")
        for name in ("never_read", "drop_renew_replies"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r:.80}")

    @property
    def on_receiver(self) -> bool:
        """Whether a receiver knob is set (the NIXL calls are then wrapped)."""
        return self.read_delay_s > 0 or self.fail_reads > 0 or self.never_read

    @property
    def active(self) -> bool:
        return self.on_receiver or self.drop_renew_replies

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        """The plan from its dict form; an unknown knob is an error, not ignored."""
        if not isinstance(d, dict):
            raise TypeError(f"a fault plan must be a map, got {type(d).__name__}")
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown fault plan knobs {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def coerce(cls, plan: FaultPlan | dict[str, Any] | None) -> FaultPlan:
        if plan is None:
            return cls()
        return plan if isinstance(plan, cls) else cls.from_dict(plan)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class ReadFaults:
    """The receiver's NIXL calls under a plan, with `NixlEndpoint`'s signatures. Only the
    worker thread calls them (the agent's API lock), so the counters need no lock."""

    def __init__(self, plan: FaultPlan, nixl: NixlEndpoint):
        self._plan = plan
        self._nixl = nixl
        self._fail_left = plan.fail_reads
        self._held: dict[Any, float] = {}  # READ handle -> monotonic time it may be posted

    def transfer(self, handle: Any) -> str:
        if self._fail_left > 0:
            self._fail_left -= 1
            return f"ERR ({INJECTED} fail_reads: NIXL_ERR_BACKEND)"
        if self._plan.never_read:
            self._held[handle] = math.inf
            return "PROC"
        if self._plan.read_delay_s > 0:
            self._held[handle] = time.monotonic() + self._plan.read_delay_s
            return "PROC"
        return self._nixl.transfer(handle)

    def check(self, handle: Any) -> str:
        due = self._held.get(handle)
        if due is None:
            return self._nixl.check(handle)
        if time.monotonic() < due:
            return "PROC"
        del self._held[handle]
        return self._nixl.transfer(handle)  # the held-back READ is posted now

    def release(self, handle: Any, what: str) -> bool:
        self._held.pop(handle, None)  # a READ never posted has nothing to cancel
        return self._nixl.release(handle, what)
