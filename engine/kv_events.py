"""KV events: a worker tells routers which block hashes its prefix cache holds, so they route
by what each worker really holds (router/kv_index.py keeps the global index).

Frames (engine.wire, msgspec, size-capped):
- `KVEventBatch` on the worker's PUB socket: the events of one engine step (at most
  `MAX_EVENTS_PER_BATCH`; a step with more sends several), each batch with the next value of a
  per-worker sequence number and the worker's `incarnation` (fresh per process, so a restarted
  worker is told apart from a gap). With no events for `HEARTBEAT_S` it sends a heartbeat: no
  events, `seq` = the last batch's, so a subscriber that lost the last batches sees the gap.
- `KVSnapshotRequest` / `KVSnapshot` on the worker's ROUTER socket: every hash held now, per
  tier, with the sequence number of the last batch already reflected in it (a resync); a
  worker holding more hashes than one frame carries answers with several parts.

`KVEventPublisher` lives in the engine server's loop thread: `BlockManager.event_sink` is its
`record`, `flush()` runs once per loop iteration, `serve_snapshots()` answers resyncs (pending
events are flushed first, so a snapshot and its `seq` always agree). No torch here: the router
imports the frames.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Literal

import zmq
from msgspec import Meta

from engine.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    Frame,
    WireError,
    decode,
    encode,
    message,
    trusted,
)

log = logging.getLogger(__name__)

MAX_EVENTS_PER_BATCH = 4096
MAX_SNAPSHOT_HASHES = 1 << 21  # per tier: 2M blocks (~19 MB of msgpack) is past any one cache
MAX_SNAPSHOT_PARTS = 4096
_HASH_BYTES = 9  # one int64 in msgpack, at most
_SNAPSHOT_OVERHEAD = 1024  # everything in a snapshot frame but its hashes, with room to spare
HEARTBEAT_S = 1.0
TIERS = ("device", "host")

_Hash = Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
_Seq = Annotated[int, Meta(ge=0)]
_Id = Annotated[str, Meta(min_length=1, max_length=256)]


class KVEvent(Frame):
    kind: Literal["stored", "removed"]
    block_hash: _Hash
    tier: Literal["device", "host"]


@message("kv_events")
class KVEventBatch(Frame):
    worker_id: _Id
    incarnation: _Id
    seq: _Seq
    block_size: Annotated[int, Meta(ge=1)]
    events: Annotated[list[KVEvent], Meta(max_length=MAX_EVENTS_PER_BATCH)] = []


@message("kv_snapshot_req")
class KVSnapshotRequest(Frame):
    pass


@message("kv_snapshot")
class KVSnapshot(Frame):
    worker_id: _Id
    incarnation: _Id
    seq: _Seq
    block_size: Annotated[int, Meta(ge=1)]
    tiers: Annotated[
        dict[
            Literal["device", "host"], Annotated[list[_Hash], Meta(max_length=MAX_SNAPSHOT_HASHES)]
        ],
        Meta(max_length=len(TIERS)),
    ] = {}
    # A snapshot too big for one frame goes as `parts` frames (part 0..parts-1), the same
    # worker, incarnation and seq in each; the listener merges them before it loads any.
    part: Annotated[int, Meta(ge=0)] = 0
    parts: Annotated[int, Meta(ge=1, le=MAX_SNAPSHOT_PARTS)] = 1

    def check(self) -> None:
        if self.part >= self.parts:
            raise ValueError(f"snapshot part {self.part} of {self.parts}")


class KVEventPublisher:
    """The worker's side: batches the block manager's events and answers resyncs."""

    def __init__(
        self,
        ctx: zmq.Context,
        worker_id: str,
        block_size: int,
        held: Callable[[], dict[str, list[int]]],
        bind_host: str = "127.0.0.1",
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        self.worker_id = worker_id
        self.incarnation = uuid.uuid4().hex
        self.block_size = block_size
        self.max_frame_bytes = max_frame_bytes
        self._held = held  # tier -> every hash held now (read in the loop thread)
        self.seq = 0
        self._pending: list[KVEvent] = []
        self._last_send = 0.0
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 10_000)  # a slow router loses batches, then resyncs
        self.pub.bind(f"tcp://{bind_host}:*")
        self.endpoint = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.snapshots = ctx.socket(zmq.ROUTER)
        self.snapshots.setsockopt(zmq.LINGER, 0)
        self.snapshots.setsockopt(zmq.MAXMSGSIZE, 64 * 1024)  # requests are tiny
        self.snapshots.bind(f"tcp://{bind_host}:*")
        self.snapshot_endpoint = self.snapshots.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.drop_next = 0  # fault injection (tests): batches built but not sent

    def record(self, kind: str, block_hash: int, tier: str) -> None:
        """`BlockManager.event_sink`: called by the engine step, in the loop thread."""
        # trusted: the block manager's own values, one per block committed (no re-validation)
        self._pending.append(trusted(KVEvent, kind, block_hash, tier))

    def flush(self) -> None:
        """Publish what the last step recorded (or a heartbeat when idle for a while)."""
        now = time.monotonic()
        if not self._pending:
            if now - self._last_send >= HEARTBEAT_S:
                self._send(self._batch([]))
                self._last_send = now
            return
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), MAX_EVENTS_PER_BATCH):
            self.seq += 1
            batch = self._batch(pending[i : i + MAX_EVENTS_PER_BATCH])
            if self.drop_next > 0:
                self.drop_next -= 1
                continue
            self._send(batch)
        self._last_send = now

    def _batch(self, events: list[KVEvent]) -> KVEventBatch:
        return trusted(
            KVEventBatch, self.worker_id, self.incarnation, self.seq, self.block_size, events
        )

    def _send(self, batch: KVEventBatch) -> None:
        try:
            self.pub.send(encode(batch, self.max_frame_bytes), zmq.NOBLOCK)
        except zmq.Again:  # no subscriber keeps up: it will see the gap and resync
            pass

    def serve_snapshots(self) -> None:
        """Answer every resync request waiting (non-blocking)."""
        while True:
            try:
                ident, *rest = self.snapshots.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                decode(rest[-1] if rest else b"", 1024, expect=KVSnapshotRequest)
            except WireError as e:
                log.error("%s: bad KV snapshot request: %s", self.worker_id, e)
                continue
            self.flush()  # the snapshot's seq must cover every event recorded so far
            try:
                frames = [encode(s, self.max_frame_bytes) for s in self.snapshot_parts()]
            except (WireError, ValueError) as e:
                log.error("%s: KV snapshot not sent: %s", self.worker_id, e)
                continue
            for frame in frames:
                self.snapshots.send_multipart([ident, *rest[:-1], frame])

    def snapshot_parts(self) -> list[KVSnapshot]:
        """What this worker holds now, cut into frames that each fit `max_frame_bytes`."""
        per_part = max(1, (self.max_frame_bytes - _SNAPSHOT_OVERHEAD) // _HASH_BYTES)
        flat = [(tier, h) for tier, hashes in self._held().items() for h in hashes]
        chunks = [flat[i : i + per_part] for i in range(0, len(flat), per_part)] or [[]]
        out = []
        for i, chunk in enumerate(chunks):
            tiers: dict[str, list[int]] = {}
            for tier, h in chunk:
                tiers.setdefault(tier, []).append(h)
            out.append(KVSnapshot(self.worker_id, self.incarnation, self.seq, self.block_size,
                                  tiers, part=i, parts=len(chunks)))  # fmt: skip
        return out

    def sockets(self) -> list[zmq.Socket]:
        return [self.pub, self.snapshots]

    def close(self) -> None:
        self.pub.close(linger=0)
        self.snapshots.close(linger=0)
