"""Sender side (prefill worker): blocks held under leases until the reader is done with them.

Lifecycle of one lease:

    hold(rid, blocks, reader)             held, unpinned, expires lease_seconds from now
      Renew{rid} from that reader         pinned (the reader is reading), expiry pushed to
                                          now + lease_seconds and the remaining time returned
      NIXL notif ReadComplete{rid}        Released read_done       (counts bytes_served)
      expiry, unpinned                    Released lease_expired   (counts expired_leases)
      expiry, pinned                      Released peer_failed     (the reader went silent)
      abort(rid), unpinned                Released aborted, at once
      abort(rid), pinned                  abort pending: Released aborted when the reader lets
                                          go (its Abort echo or the notif) or at expiry

A released lease leaves a tombstone (its outcome and reader), so a renewal that arrives late
is answered truthfully ("done", "aborted", "expired") instead of "unknown". Readers are the
receivers that handshook on our ROUTER, known by their ZMQ identity.

All of this state is under `LeaseTable`'s own lock; it is taken by the worker thread (hold,
abort, poll) and the side-channel thread (renewals, aborts, notifications) and never held
while calling into another part. Frames for readers wait in `take_outgoing()` for the
side-channel thread, which owns the sockets.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from engine.wire import WireError, decode
from kv_transfer.descriptors import check_block_ids
from kv_transfer.errors import TransferError
from kv_transfer.events import Released, TransferStats
from kv_transfer.messages import MAX_NOTIF_BYTES, Abort, ReadComplete, Renew, RenewReply

log = logging.getLogger(__name__)

_TOMBSTONES = 8192  # recently finished requests, to answer late renewals truthfully
# What a late renewal hears about a request already released, by the release reason.
_RENEW_STATUS = {
    "read_done": "done",
    "aborted": "aborted",
    "lease_expired": "expired",
    "peer_failed": "expired",
}


@dataclass(slots=True)
class _Lease:
    """Blocks held for one reader until `expires_at` (monotonic)."""

    request_id: str
    block_ids: tuple[int, ...]
    peer: str
    expires_at: float
    pinned: bool = False  # the reader said it is reading: free only on notif/abort/expiry
    abort_pending: bool = False  # aborted here while pinned: waiting for the reader to let go
    pinned_at: float | None = None  # monotonic time of the first renew: the reader started


@dataclass(slots=True)
class _Reader:
    """A receiver that handshook on our ROUTER."""

    name: str
    instance_id: str
    identity: bytes


class LeaseTable:
    """The sender's leases and readers; see the module docstring."""

    def __init__(self, lease_seconds: float, num_blocks: int, bytes_per_block: int):
        self.lease_seconds = lease_seconds
        self._num_blocks = num_blocks
        self._bytes_per_block = bytes_per_block
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._tombstones: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self._readers: dict[bytes, _Reader] = {}
        self._ident_by_name: dict[str, bytes] = {}
        self._outgoing: list[tuple[bytes, Any]] = []
        self._events: list[Released] = []
        self._stats = TransferStats()

    # ------------------------------------------------------------------ worker thread

    def hold(self, request_id: str, block_ids: list[int], peer_name: str) -> float:
        """Start a lease; returns its deadline in unix seconds."""
        ids = check_block_ids(request_id, block_ids, self._num_blocks)
        if not isinstance(peer_name, str) or not peer_name:
            raise TransferError(request_id, "peer_name must be a non-empty string")
        with self._lock:
            if request_id in self._leases:
                raise TransferError(request_id, "its blocks are already held")
            self._tombstones.pop(request_id, None)
            self._leases[request_id] = _Lease(
                request_id, ids, peer_name, time.monotonic() + self.lease_seconds
            )
            return time.time() + self.lease_seconds

    def abort(self, request_id: str) -> bool:
        """Give a lease up and tell its reader; returns whether it was held."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return False
            ident = self._ident_by_name.get(lease.peer)
            if ident is not None:
                self._outgoing.append((ident, Abort(request_id, "aborted by sender")))
            if lease.pinned:
                lease.abort_pending = True  # a READ may still land: wait for the reader
            else:
                self._release(lease, "aborted")
            return True

    def expire(self, now: float) -> None:
        with self._lock:
            for lease in [x for x in self._leases.values() if now >= x.expires_at]:
                self._expire(lease)

    def on_notifs(self, notifs: dict[str, list[bytes]]) -> None:
        """NIXL notifications: a reader's last READ chunk landed, so its blocks are free."""
        if not notifs:
            return
        with self._lock:
            for agent, msgs in notifs.items():
                for raw in msgs:
                    try:
                        rid = decode(raw, MAX_NOTIF_BYTES, expect=ReadComplete).request_id
                    except WireError as e:
                        log.warning("dropping a malformed notification from %s: %s", agent, e)
                        self._stats.ignored_notifs += 1
                        continue
                    lease = self._leases.get(rid)
                    if lease is None or lease.peer != agent:
                        self._stats.ignored_notifs += 1  # late, aborted or never ours
                        continue
                    self._stats.bytes_served += len(lease.block_ids) * self._bytes_per_block
                    if lease.pinned_at is not None:
                        self._stats.serve_seconds += time.monotonic() - lease.pinned_at
                    self._release(lease, "aborted" if lease.abort_pending else "read_done")

    def take_events(self) -> list[Released]:
        with self._lock:
            events, self._events = self._events, []
            return events

    def num_held(self) -> int:
        with self._lock:
            return len(self._leases)

    def stats(self) -> TransferStats:
        with self._lock:
            return dataclasses.replace(self._stats)

    # ------------------------------------------------------------------ side-channel thread

    def add_reader(self, identity: bytes, name: str, instance_id: str) -> None:
        """A receiver handshook; a restarted one (same name, new identity) replaces the old."""
        with self._lock:
            old = self._ident_by_name.get(name)
            if old is not None and old != identity:
                self._readers.pop(old, None)
            self._readers[identity] = _Reader(name, instance_id, identity)
            self._ident_by_name[name] = identity

    def reader_name(self, identity: bytes) -> str | None:
        with self._lock:
            reader = self._readers.get(identity)
            return None if reader is None else reader.name

    def on_renew(self, reader: str, renew: Renew) -> RenewReply:
        """Pin and extend each lease `reader` holds; say what became of the others."""
        now = time.monotonic()
        statuses, remaining = [], []
        with self._lock:
            for rid in renew.request_ids:
                lease = self._leases.get(rid)
                if lease is not None and lease.peer == reader and now >= lease.expires_at:
                    self._expire(lease)
                    lease = None
                if lease is None or lease.peer != reader:
                    outcome, holder = self._tombstones.get(rid, ("", ""))
                    status = _RENEW_STATUS.get(outcome, "unknown")
                    statuses.append(status if holder == reader else "unknown")
                    remaining.append(0.0)
                elif lease.abort_pending:
                    statuses.append("aborted")
                    remaining.append(0.0)
                else:
                    lease.pinned = True
                    if lease.pinned_at is None:
                        lease.pinned_at = now
                    lease.expires_at = max(lease.expires_at, now + self.lease_seconds)
                    statuses.append("ok")
                    remaining.append(lease.expires_at - now)
        return RenewReply(renew.seq, list(renew.request_ids), statuses, remaining)

    def on_abort(self, reader: str, abort: Abort) -> None:
        """The reader will not read (or has let go): free the blocks now, pinned or not."""
        with self._lock:
            lease = self._leases.get(abort.request_id)
            if lease is not None and lease.peer == reader:
                self._release(lease, "aborted")

    def any_pinned(self) -> bool:
        with self._lock:
            return any(x.pinned for x in self._leases.values())

    def take_outgoing(self) -> list[tuple[bytes, Any]]:
        """Frames for readers, by ZMQ identity, in the order they were queued."""
        with self._lock:
            out, self._outgoing = self._outgoing, []
            return out

    # ------------------------------------------------------------------ internals (lock held)

    def _expire(self, lease: _Lease) -> None:
        self._stats.expired_leases += 1
        if lease.abort_pending:
            self._release(lease, "aborted")
        elif lease.pinned:
            self._stats.failures += 1  # the reader started, then went silent
            self._release(lease, "peer_failed")
        else:
            self._release(lease, "lease_expired")

    def _release(self, lease: _Lease, reason: str) -> None:
        """The blocks go back to the worker at its next poll()."""
        del self._leases[lease.request_id]
        if reason == "aborted":
            self._stats.aborted += 1
        self._tombstones[lease.request_id] = (reason, lease.peer)
        while len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)
        self._events.append(Released(lease.request_id, lease.block_ids, reason))
