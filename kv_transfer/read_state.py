"""The receiver's records (kv_transfer/receiver.py): a sender it READs from (`_PeerOut`), one
request's pull (`_Read`), and its settings. Plain state; the transitions are the receiver's.

A read from a sender of another layout by a tensor-parallel receiver has one more stage
before rank 0's own READs: `ranks_out` while the other ranks' READs (kv_transfer/tp_read.py)
are posted and not yet known landed or cancelled; see tp_read.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import zmq

from kv_transfer.messages import TransferStatus
from kv_transfer.nixl import BlockRegion
from kv_transfer.tp_layout import HeadSlice, SlicePlan


@dataclass(slots=True)
class PeerOut:
    """A sender we READ from."""

    name: str
    instance_id: str
    endpoint: str
    sock: zmq.Socket  # owned by the side-channel thread once connect() returns
    region: BlockRegion
    dlist: Any  # NIXL prepped remote descriptor list
    alive: bool = True
    dead_reason: str = ""
    seq: int = 0
    sent_at: dict[int, float] = field(default_factory=dict)  # renew seq -> monotonic send time
    awaiting_since: float | None = None  # oldest unanswered renew
    plan: SlicePlan | None = None  # a sender of another TP layout: READs per head slice
    ranks: list[str] = field(default_factory=list)  # its other ranks' NIXL agents we loaded


@dataclass(slots=True)
class Read:
    """One request's pull."""

    request_id: str
    peer: str
    local_ids: tuple[int, ...]
    # (remote ids, local ids, head slice or None: whole blocks from the peer) per READ
    chunks: list[tuple[list[int], list[int], HeadSlice | None]]
    lease_until: float  # monotonic; from KVReady, then from the sender's renew replies
    started_at: float
    num_bytes: int
    status: TransferStatus = field(default_factory=TransferStatus)
    next_chunk: int = 0
    handle: Any = None  # NIXL xfer handle of the chunk in flight
    # Monotonic; when the sender confirmed the blocks were held (pinned) for us (None: not yet).
    acked_at: float | None = None
    landed_at: float | None = None
    tell_sender: bool = False  # on failure, send Abort so the sender frees at once
    aborted: bool = False
    ranks_out: bool = False  # the other ranks' READs posted, not yet landed or cancelled

    @property
    def acked(self) -> bool:
        return self.acked_at is not None


@dataclass(slots=True, frozen=True)
class ReceiverConfig:
    read_timeout_s: float
    peer_timeout_s: float
    handshake_timeout_s: float
    max_read_bytes: int
    max_frame_bytes: int
    warmup: bool
