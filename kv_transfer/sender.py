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

      its reader restarted                Released peer_restarted, at once (see below)

A released lease leaves a tombstone (its outcome and reader), so a renewal that arrives late
is answered truthfully ("done", "aborted", "expired") instead of "unknown". Readers are the
receivers that handshook on our ROUTER, known by their ZMQ identity.

Incarnations (a restarted worker keeps its name and gets a new agent instance id):

- a lease is held for a reader *name*; the first renewal binds it to that reader's *instance*
  (pinned). Renewals and aborts for it from another instance of the same name are answered
  "unknown" / ignored, as from a stranger.
- when a reader of name N handshakes with a new instance, or the allowed map (`set_policy`)
  names a new instance for N, every lease pinned by an older instance of N is released at once
  as `peer_restarted` (counted in restarted_leases and failures): Ray restarts an actor only
  after its process died, so no READ of the old instance can still land. Unpinned leases for N
  stay held, for the new instance, until their normal expiry.
- with an allowed map (`set_policy`), a Hello from a (name, instance) outside it registers no
  reader and is refused (counted in refused_peers); readers the new map no longer allows are
  dropped (their renewals are then refused as if they had never handshaken). A name removed
  from the map is not "replaced": its pinned leases run to their normal expiry, since that
  reader may still be alive. `hold` does not check the map: it may lag the router by a moment.

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

from engine.protocol import WireError, decode
from kv_transfer.errors import PeerNotAllowedError, TransferError
from kv_transfer.messages import (
    MAX_NOTIF_BYTES,
    Abort,
    PeerPolicy,
    ReadComplete,
    Released,
    Renew,
    RenewReply,
    TransferStats,
)
from kv_transfer.nixl import check_block_ids

log = logging.getLogger(__name__)

_TOMBSTONES = 8192  # recently finished requests, to answer late renewals truthfully
# What a late renewal hears about a request already released, by the release reason.
_RENEW_STATUS = {
    "read_done": "done",
    "aborted": "aborted",
    "lease_expired": "expired",
    "peer_failed": "expired",
    "peer_restarted": "expired",
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
    held_at: float = dataclasses.field(default_factory=time.monotonic)  # when hold() made it
    reader_instance: str | None = None  # the reader instance that pinned it (first renew)

    def held_for(self, reader: _Reader | None) -> bool:
        """Whether `reader` is the one this lease is for: its name, and its instance once
        pinned (another incarnation of the same name is a stranger)."""
        return (
            reader is not None
            and self.peer == reader.name
            and self.reader_instance in (None, reader.instance_id)
        )


@dataclass(slots=True)
class _Reader:
    """A receiver that handshook on our ROUTER."""

    name: str
    instance_id: str
    identity: bytes


class LeaseTable:
    """The sender's leases and readers; see the module docstring."""

    def __init__(
        self, lease_seconds: float, num_blocks: int, bytes_per_block: int, owner: str = "sender"
    ):
        self.lease_seconds = lease_seconds
        self._owner = owner  # our agent name, for refusal messages
        self._num_blocks = num_blocks
        self._bytes_per_block = bytes_per_block
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        # rid -> (release reason, reader name, reader instance that had pinned it or None)
        self._tombstones: collections.OrderedDict[str, tuple[str, str, str | None]] = (
            collections.OrderedDict()
        )
        self._policy = PeerPolicy()
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
            if ident is not None and lease.held_for(self._readers.get(ident)):
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
                    # A short READ can land before the side-channel thread has handled the
                    # reader's first renew: then the lease's age is the closest bound we have.
                    started = lease.held_at if lease.pinned_at is None else lease.pinned_at
                    self._stats.serve_seconds += time.monotonic() - started
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

    def refusal(self, name: str, instance_id: str) -> PeerNotAllowedError | None:
        """Why a Hello from (name, instance_id) must be refused, or None (counted)."""
        with self._lock:
            return self._refusal(name, instance_id)

    def add_reader(
        self, identity: bytes, name: str, instance_id: str
    ) -> PeerNotAllowedError | None:
        """A receiver handshook: register it, or return why it is refused (then nothing is
        registered). A restarted one (same name, new instance) replaces the old, and the
        leases the old instance pinned are released at once (see the module docstring)."""
        with self._lock:
            refusal = self._refusal(name, instance_id)  # again: the map may have just changed
            if refusal is not None:
                return refusal
            old = self._ident_by_name.get(name)
            if old is not None and old != identity:
                self._readers.pop(old, None)
            self._readers[identity] = _Reader(name, instance_id, identity)
            self._ident_by_name[name] = identity
            self._release_older_instances(name, instance_id)
            return None

    def set_policy(self, policy: PeerPolicy) -> None:
        """A new allowed map: drop the readers it does not allow; release the leases pinned by
        an instance it replaced (a name removed from the map is not replaced)."""
        with self._lock:
            self._policy = policy
            for ident, reader in list(self._readers.items()):
                if not policy.allows(reader.name, reader.instance_id):
                    del self._readers[ident]
                    if self._ident_by_name.get(reader.name) == ident:
                        del self._ident_by_name[reader.name]
            for lease in list(self._leases.values()):
                inst = lease.reader_instance
                if inst is not None and policy.replaced(lease.peer, inst):
                    self._release_restarted(lease)

    def reader_name(self, identity: bytes) -> str | None:
        with self._lock:
            reader = self._readers.get(identity)
            return None if reader is None else reader.name

    def on_renew(self, identity: bytes, renew: Renew) -> RenewReply:
        """Pin and extend each lease held for the reader at `identity`; say what became of
        the others. The first renewal binds a lease to the reader's instance."""
        now = time.monotonic()
        statuses, remaining = [], []
        with self._lock:
            reader = self._readers.get(identity)
            for rid in renew.request_ids:
                lease = self._leases.get(rid)
                mine = lease is not None and lease.held_for(reader)
                if mine and now >= lease.expires_at:
                    self._expire(lease)
                    mine = False
                if not mine:
                    statuses.append(self._late_status(rid, reader))
                    remaining.append(0.0)
                elif lease.abort_pending:
                    statuses.append("aborted")
                    remaining.append(0.0)
                else:
                    lease.pinned = True
                    lease.reader_instance = reader.instance_id
                    if lease.pinned_at is None:
                        lease.pinned_at = now
                    lease.expires_at = max(lease.expires_at, now + self.lease_seconds)
                    statuses.append("ok")
                    remaining.append(lease.expires_at - now)
        return RenewReply(renew.seq, list(renew.request_ids), statuses, remaining)

    def on_abort(self, identity: bytes, abort: Abort) -> None:
        """The reader will not read (or has let go): free the blocks now, pinned or not."""
        with self._lock:
            lease = self._leases.get(abort.request_id)
            if lease is not None and lease.held_for(self._readers.get(identity)):
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

    def _refusal(self, name: str, instance_id: str) -> PeerNotAllowedError | None:
        refusal = self._policy.refusal(self._owner, name, instance_id)
        if refusal is not None:
            self._stats.refused_peers += 1
        return refusal

    def _late_status(self, rid: str, reader: _Reader | None) -> str:
        """What a renewal hears of a lease it does not hold: its outcome if it was this
        reader's (instance included once pinned), else "unknown"."""
        outcome, name, instance = self._tombstones.get(rid, ("", "", None))
        if reader is None or name != reader.name or instance not in (None, reader.instance_id):
            return "unknown"
        return _RENEW_STATUS.get(outcome, "unknown")

    def _release_older_instances(self, name: str, instance: str) -> None:
        for lease in list(self._leases.values()):
            if lease.peer == name and lease.reader_instance not in (None, instance):
                self._release_restarted(lease)

    def _release_restarted(self, lease: _Lease) -> None:
        """The reader that pinned `lease` was replaced: its process is dead, free at once."""
        if lease.abort_pending:
            self._release(lease, "aborted")
            return
        self._stats.restarted_leases += 1
        self._stats.failures += 1
        self._release(lease, "peer_restarted")

    def _release(self, lease: _Lease, reason: str) -> None:
        """The blocks go back to the worker at its next poll()."""
        del self._leases[lease.request_id]
        if reason == "aborted":
            self._stats.aborted += 1
        self._tombstones[lease.request_id] = (reason, lease.peer, lease.reader_instance)
        while len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)
        self._events.append(Released(lease.request_id, lease.block_ids, reason))
