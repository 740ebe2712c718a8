"""The router's KV event subscriber: one SUB socket connected to every worker's KV events
endpoint, feeding `router.kv_index.KVIndex`, and the resyncs the index asks for.

`sync(workers)` runs on every directory snapshot: a worker seen for the first time (or as a
new incarnation, or at a new endpoint) is connected and resynced at once — so a router started
after the workers, or a worker that restarted, is caught up without waiting for an event — and
a worker that left the directory (or is DOWN) is disconnected and forgotten. A resync is one
`KVSnapshotRequest` on a fresh DEALER socket to the worker's snapshot endpoint, answered (in
one frame, or in parts that are merged) within `RESYNC_TIMEOUT_S` or abandoned (the worker's
next batch or heartbeat asks again), at most one
in flight per worker. Frames are msgspec (engine.protocol), size-capped; a bad one is counted and
dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq
import zmq.asyncio

from engine.kv_events import KVEventBatch, KVSnapshot, KVSnapshotRequest
from engine.protocol import WireError, decode, encode
from router.directory import DOWN, WorkerInfo
from router.kv_index import KVIndex
from router.tasks import cancel_and_wait

log = logging.getLogger(__name__)

RESYNC_TIMEOUT_S = 5.0


class KVEventListener:
    def __init__(self, index: KVIndex, max_frame_bytes: int = 64 << 20) -> None:
        self.index = index
        self.max_frame_bytes = max_frame_bytes
        self.num_batches = 0
        self.num_resyncs = 0
        self.num_resync_failures = 0
        self.num_bad_frames = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        # worker id -> (incarnation, events endpoint, snapshot endpoint) as connected
        self._known: dict[str, tuple[str, str, str]] = {}
        self._resyncing: dict[str, asyncio.Task] = {}

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._task = asyncio.create_task(self._recv_loop(), name="router-kv-events")

    async def stop(self) -> None:
        for t in [t for t in (self._task, *self._resyncing.values()) if t is not None]:
            await cancel_and_wait(t)
        self._task = None
        self._resyncing.clear()
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        if self._ctx is not None:
            # destroy closes a resync socket whose cancelled task has not run its `finally`
            # yet (term() would block the loop that task needs, for good).
            self._ctx.destroy(linger=0)
            self._ctx = None

    def sync(self, workers: list[WorkerInfo]) -> None:
        """Follow the directory: connect new workers (and resync them), forget gone ones."""
        if self._sub is None:
            return
        live = {
            w.worker_id: (w.incarnation, w.kv_events_endpoint, w.kv_snapshot_endpoint)
            for w in workers
            if w.state != DOWN and w.kv_events_endpoint and w.kv_snapshot_endpoint
        }
        for wid, known in list(self._known.items()):
            if live.get(wid) != known:
                self._disconnect(wid, known[1])
        for wid, (inc, events, snapshot) in live.items():
            if wid not in self._known:
                self._sub.connect(events)
                self._known[wid] = (inc, events, snapshot)
                self.resync(wid)

    def _disconnect(self, wid: str, endpoint: str) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sub.disconnect(endpoint)
        del self._known[wid]
        task = self._resyncing.pop(wid, None)
        if task is not None:
            task.cancel()
        self.index.forget(wid)

    def resync(self, wid: str) -> None:
        """Ask `wid` for a snapshot, unless one is already on its way."""
        if wid in self._resyncing or wid not in self._known:
            return
        self._resyncing[wid] = asyncio.create_task(self._resync(wid), name=f"kv-resync-{wid}")

    async def _resync(self, wid: str) -> None:
        endpoint = self._known[wid][2]
        # DEALER, not REQ: a snapshot may come as several frames (parts) to one request.
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        again = False
        try:
            sock.connect(endpoint)
            await sock.send_multipart([b"", encode(KVSnapshotRequest())])
            snap = await asyncio.wait_for(self._receive_parts(sock, wid), RESYNC_TIMEOUT_S)
            self.num_resyncs += 1
            again = self.index.load_snapshot(snap)
        except (TimeoutError, WireError, ValueError, zmq.ZMQError) as e:
            self.num_resync_failures += 1
            log.warning("KV index resync of %s failed: %s", wid, e)
        finally:
            sock.close(linger=0)
            if self._resyncing.get(wid) is asyncio.current_task():
                del self._resyncing[wid]
        if again:
            self.resync(wid)

    async def _receive_parts(self, sock: zmq.asyncio.Socket, wid: str) -> KVSnapshot:
        """Every part of one snapshot, merged (parts must agree on worker, incarnation and
        seq, and come once each)."""
        got: dict[int, KVSnapshot] = {}
        while True:
            frame = (await sock.recv_multipart())[-1]
            snap = decode(frame, self.max_frame_bytes, expect=KVSnapshot)
            if snap.worker_id != wid:
                raise WireError(f"snapshot from {snap.worker_id!r}, asked {wid!r}")
            first = next(iter(got.values()), snap)
            key = (snap.incarnation, snap.seq, snap.parts)
            if key != (first.incarnation, first.seq, first.parts) or snap.part in got:
                raise WireError(f"snapshot part {snap.part}/{snap.parts} does not fit the rest")
            got[snap.part] = snap
            if len(got) == snap.parts:
                break
        tiers: dict[str, list[int]] = {}
        for i in range(len(got)):
            for tier, hashes in got[i].tiers.items():
                tiers.setdefault(tier, []).extend(hashes)
        s = got[0]
        return KVSnapshot(s.worker_id, s.incarnation, s.seq, s.block_size, tiers)

    async def _recv_loop(self) -> None:
        while True:
            try:
                frame = await self._sub.recv()
            except zmq.ZMQError as e:
                if e.errno == zmq.ETERM:
                    return
                raise
            try:
                batch = decode(frame, self.max_frame_bytes, expect=KVEventBatch)
            except WireError as e:
                self.num_bad_frames += 1
                log.error("dropped a bad KV event frame (%d bytes): %s", len(frame), e)
                continue
            if batch.worker_id not in self._known:
                continue  # not (or no longer) in the directory
            self.num_batches += 1
            try:
                if self.index.apply(batch):
                    self.resync(batch.worker_id)
            except Exception:  # noqa: BLE001 - never let one batch stop the index's feed
                log.exception("KV event batch from %s not applied", batch.worker_id)
                self.resync(batch.worker_id)
