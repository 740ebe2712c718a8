"""Per-request transfer state: an ordered enum that only moves forward.

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
