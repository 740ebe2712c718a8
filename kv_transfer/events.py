"""What `KVTransferAgent` reports: each request's transfer state, the events `poll()` hands the
worker loop, and the agent's counters.

Sender side: `Released` -> the worker frees those blocks. Receiver side: `ReadDone` -> the
sequence joins the batch; `ReadFailed` -> the worker frees its blocks and fails or recomputes.
An event is emitted only once nothing can touch the blocks any more (no READ in flight).

A request's transfer state (`TransferState`, `TransferStatus`): an ordered enum that only
moves forward.

    PENDING -> TRANSFERRING -> DONE
       \\            \\
        +------------+--> FAILED (sticky, carries the reason)

The order FAILED < PENDING < TRANSFERRING < DONE lets callers compare states ("at least
TRANSFERRING") the way SGLang's KVPoll does; FAILED sorts lowest because a failed transfer has
achieved the least. DONE and FAILED are terminal.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class TransferState(enum.IntEnum):
    FAILED = 0
    PENDING = 1
    TRANSFERRING = 2
    DONE = 3

    @property
    def terminal(self) -> bool:
        return self in (TransferState.FAILED, TransferState.DONE)


class InvalidTransition(ValueError):
    """A state change that would move a transfer backwards or out of a terminal state."""


@dataclass(slots=True)
class TransferStatus:
    state: TransferState = TransferState.PENDING
    reason: str | None = None  # set once, when the state becomes FAILED

    def __post_init__(self) -> None:
        self.state = TransferState(self.state)
        if self.state is TransferState.FAILED and not self.reason:
            raise ValueError("a FAILED status needs a reason")

    def advance(self, new: TransferState) -> None:
        """Move forward to `new` (PENDING -> TRANSFERRING -> DONE); use fail() for FAILED."""
        new = TransferState(new)
        if new is TransferState.FAILED:
            raise InvalidTransition("use fail(reason) to mark a transfer FAILED")
        if self.state.terminal or new <= self.state:
            raise InvalidTransition(f"cannot move from {self.state.name} to {new.name}")
        self.state = new

    def fail(self, reason: str) -> bool:
        """Mark FAILED with `reason`; returns False (and keeps the first reason) if already FAILED.

        A DONE transfer cannot fail: its blocks are already the receiver's.
        """
        if not reason:
            raise ValueError("a failure needs a reason")
        if self.state is TransferState.FAILED:
            return False
        if self.state is TransferState.DONE:
            raise InvalidTransition(f"cannot fail a DONE transfer ({reason})")
        self.state = TransferState.FAILED
        self.reason = reason
        return True


# peer_restarted: the reader that pinned the lease was replaced by a new incarnation of the
# same name (its process is dead, so no READ of it can land): freed at once, not at expiry.
RELEASE_REASONS = ("read_done", "lease_expired", "aborted", "peer_failed", "peer_restarted")


@dataclass(slots=True, frozen=True)
class Released:
    request_id: str
    block_ids: tuple[int, ...]
    reason: str  # one of RELEASE_REASONS

    def __post_init__(self) -> None:
        if self.reason not in RELEASE_REASONS:
            raise ValueError(f"reason must be one of {RELEASE_REASONS}, got {self.reason!r}")


@dataclass(slots=True, frozen=True)
class ReadDone:
    request_id: str
    local_block_ids: tuple[int, ...]
    num_bytes: int
    seconds: float


@dataclass(slots=True, frozen=True)
class ReadFailed:
    request_id: str
    local_block_ids: tuple[int, ...]
    reason: str


TransferEvent = Released | ReadDone | ReadFailed


@dataclass(slots=True)
class TransferStats:
    """Plain counters for /metrics (tandem_kv_transfer_*)."""

    bytes_read: int = 0  # receiver: bytes pulled by completed READs (data + FP8 scales)
    seconds: float = 0.0  # receiver: wall time of those READs, first post to landing
    transfers: int = 0  # receiver: requests that reached DONE
    failures: int = 0  # both: requests that ended FAILED / released because a peer failed
    expired_leases: int = 0  # sender: leases that ran out
    aborted: int = 0  # both: requests aborted by either side
    bytes_served: int = 0  # sender: bytes of blocks released after a completed READ
    serve_seconds: float = 0.0  # sender: reader's first renew (else the hold) to READ completion
    rejected_frames: int = 0  # side-channel frames refused as malformed / oversized
    ignored_notifs: int = 0  # late or unknown NIXL notifications that were dropped
    handshakes: int = 0
    refused_peers: int = 0  # both: handshakes refused because the peer is not allowed
    restarted_leases: int = 0  # sender: pinned leases freed at once, their reader restarted

    @property
    def gbps(self) -> float:
        """Achieved receive bandwidth in GB/s (1e9 bytes) over all completed READs."""
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __add__(self, other: TransferStats) -> TransferStats:
        """The counters of two parts of one agent (sender, receiver, side channel) summed."""
        return TransferStats(
            **{k: getattr(self, k) + getattr(other, k) for k in self.__dataclass_fields__}
        )

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["gbps"] = self.gbps
        return d
