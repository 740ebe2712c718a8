"""KV events, and the block hash they name: a worker tells routers which block hashes its
prefix cache holds, so they route by what each worker really holds (router/kv_index.py keeps
the global index).

The block hash (`hash_block`, `prefix_block_hashes`, `lookup_blocks`) is the name every event
carries, computed alike by the engine (`kv_cache.BlockManager`, the scheduler) and the router
(`router.kv_index`), in other processes, from the same token ids: Python's `hash()` would not
do (before 3.12, `hash(None)` — the chain's seed — is an address, different in every process).
A block's hash chains the previous block's hash with this block's token ids, so equal hashes
mean equal prefixes. Values are signed 64-bit ints (they travel in msgpack frames as ints).
A request's `cache_salt` (vLLM's) seeds the chain in place of the constant seed: its blocks
hash apart from every other salt's (and the unsalted ones), so a tenant cannot learn from the
time to first token whether another tenant sent a prompt. Every hash of a salted request's
blocks must be computed with its salt: the engine's cache, the hand-off's adoption, a prefix
pull, the host tier and the router's index alike.

Frames (engine.protocol's codec, msgspec, size-capped):
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
imports the frames and the hash.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Literal

import zmq
from msgspec import Meta

from engine.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    Frame,
    WireError,
    decode,
    encode,
    message,
    trusted,
)

log = logging.getLogger(__name__)

# --- The block hash: the name an event carries, computed alike by router and engine ----------

_SEED = b"tandem-kv-block-v1"


def chain_seed(salt: str | None) -> bytes:
    """What the first block of a request salted `salt` (None: unsalted) is hashed after."""
    if salt is None:
        return _SEED
    return hashlib.blake2b(_SEED + b"\0" + salt.encode(), digest_size=16).digest()


def hash_block(prev_hash: int | None, token_ids: tuple[int, ...], salt: str | None = None) -> int:
    """The hash of a block holding `token_ids` after the block hashed `prev_hash` (None: the
    first block of a sequence, whose request is salted `salt`)."""
    head = chain_seed(salt) if prev_hash is None else struct.pack("<q", prev_hash)
    # int64 per token: a token id is never out of range for the packing (no error mid-commit).
    body = struct.pack(f"<{len(token_ids)}q", *token_ids)
    digest = hashlib.blake2b(head + body, digest_size=8).digest()
    return struct.unpack("<q", digest)[0]


def prefix_block_hashes(
    token_ids: list[int], block_size: int, max_blocks: int, salt: str | None = None
) -> list[int]:
    """The hashes of the first `max_blocks` full blocks of `token_ids`, in order."""
    n = min(max_blocks, len(token_ids) // block_size)
    # Packed once and sliced: the same bytes `hash_block` hashes, at a third of its cost.
    data = struct.pack(f"<{n * block_size}q", *token_ids[: n * block_size])
    step = 8 * block_size
    out: list[int] = []
    head = chain_seed(salt)
    for b in range(n):
        digest = hashlib.blake2b(head + data[b * step : (b + 1) * step], digest_size=8).digest()
        head = digest
        out.append(struct.unpack("<q", digest)[0])
    return out


def lookup_blocks(prompt_len: int, block_size: int) -> int:
    """How many leading blocks of a prompt a prefix cache may serve: never the last prompt
    token (its logits are needed), so at most `(prompt_len - 1) // block_size`."""
    return max(0, (prompt_len - 1) // block_size)


# --- The events: frames and the worker's publisher -------------------------------------------

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
