"""Receiver side (decode worker): handshakes with senders and pulls their blocks with READs.

Lifecycle of one read (`TransferState`, only forward; FAILED is sticky):

    start_read          PENDING: a Renew{rid} is queued (it pins the sender's lease) and the
                        first chunk is posted
    chunk posted        TRANSFERRING; at most max_read_bytes per READ, the next one posted by
                        poll() when the previous landed, the lease checked before each; the
                        last chunk carries the NIXL notification ReadComplete{rid}
    all chunks landed   and a RenewReply said the sender held the blocks ("ok", or "done"
                        when the notification won the race) and the landing was before the
                        lease deadline: DONE -> ReadDone
    anything else       FAILED -> ReadFailed, once the READ handle is released (cancelled)

A read ends FAILED at the earliest of: NIXL reporting an error (a killed sender disconnects;
any other NIXL error also tells the sender to free its blocks once the handle is released),
`peer_timeout_s` without an answer to a renewal (a hung sender), `read_timeout_s` after
`start_read`, the sender reporting the lease expired or aborted, a lease known to have expired
before a chunk could start (50 ms margin), or an abort. A sender marked down stays down until
`connect()` is called again (a restarted peer has a new instance id and re-handshakes).

Peers: `connect` dials the sender's side channel with a DEALER, checks compatibility on both
ends, loads its NIXL metadata, preps its descriptor list once and warms the pair up with a
1-block READ; then the socket is handed to the side-channel thread. Renewals are the
heartbeat: the side-channel thread calls `beat()` every heartbeat_s and sends what
`take_outgoing()` returns, so a worker stuck in a forward pass keeps its leases.

Allowed peers and incarnations (`set_policy`, see messages.py): with an allowed map, `connect`
refuses metadata whose (name, instance id) is not the allowed one *before dialling*
(`UnknownPeerError`, `StalePeerError`; counted in refused_peers), so a KVReady from an old
incarnation of a restarted sender never leads to a READ of its block ids. A new map drops the
senders it no longer allows: their reads fail (ReadFailed naming the peer), their NIXL state
and socket are released. `start_read(..., sender_instance=...)` also refuses a read whose
KVReady named another instance than the connected one. Without a map (standalone use) the
last `connect` for a name wins: a different instance replaces the connected one.

A tensor-parallel receiver (`ranks`, tp_read.RankReads): after the pinning renewal its other
ranks READ their heads first (`Read.ranks_out`, polled once per `advance` for every such read);
rank 0's chunks follow once all landed. A rank's failure fails the read, and it is settled only
once every rank released its READs.

Fault injection (faults.py): the NIXL post/check/release calls are bound once, at
construction, to `NixlEndpoint`'s own methods, or to `ReadFaults`' wrappers when a plan sets a
receiver knob; never_read also turns renewals off.

State is under `Receiver`'s own lock. NIXL calls (posting a chunk, which on CPU copies inside
the call) are made without it, so renewals keep flowing during a READ; the READ handles
themselves are touched only by the worker thread (the facade serializes public calls).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from typing import Any, Literal

import zmq

from engine.protocol import encode
from kv_transfer.errors import HandshakeError, TransferError, quietly
from kv_transfer.faults import FaultPlan, ReadFaults
from kv_transfer.handshake import exchange_hello, open_peer
from kv_transfer.messages import (
    MAX_RIDS_PER_RENEW,
    Abort,
    AgentMetadata,
    Compat,
    ErrorReply,
    Hello,
    PeerPolicy,
    ReadComplete,
    ReadDone,
    ReadFailed,
    Renew,
    RenewReply,
    TransferEvent,
    TransferState,
    TransferStats,
)
from kv_transfer.nixl import NixlEndpoint, check_block_ids, chunk
from kv_transfer.read_state import PeerOut, Read, ReceiverConfig
from kv_transfer.side_channel import SideChannel
from kv_transfer.tp_read import RankReads

log = logging.getLogger(__name__)

_LEASE_MARGIN_S = 0.05  # never start a READ this close to the lease's end
_MAX_UNANSWERED = 1024  # renew send times kept per peer


class Receiver:
    """The receiver's peers and reads; see the module docstring."""

    def __init__(
        self,
        hello: Hello,
        compat: Compat,
        nixl: NixlEndpoint,
        channel: SideChannel,
        config: ReceiverConfig,
        faults: FaultPlan | None = None,
        ranks: RankReads | None = None,
    ):
        self._ranks = ranks  # a TP receiver: its other ranks READ their heads (tp_read.py)
        self._hello = hello  # what we tell every sender at handshake
        self._compat = compat
        self._nixl = nixl
        self._channel = channel
        self._cfg = config
        self._region = nixl.region
        self._blocks_per_chunk = max(1, config.max_read_bytes // self._region.bytes_per_block)
        self._lock = threading.Lock()
        self._peers: dict[str, PeerOut] = {}
        self._reads: dict[str, Read] = {}
        self._outgoing: list[tuple[str, list[str] | Abort]] = []  # rids to renew, or an Abort
        self._events: list[TransferEvent] = []
        self._stats = TransferStats()
        self._policy = PeerPolicy()
        # Bound once: with no receiver fault these are NIXL's own calls, nothing in between.
        ops = ReadFaults(faults, nixl) if faults is not None and faults.on_receiver else nixl
        self._post, self._check, self._release_xfer = ops.transfer, ops.check, ops.release
        self._renews = faults is None or not faults.never_read

    # ------------------------------------------------------------------ connect

    def connect(self, md: AgentMetadata) -> None:
        """Handshake with a sender once per instance; raise HandshakeError on a refusal."""
        with self._lock:
            refusal = self._policy.refusal(self._hello.name, md.name, md.instance_id)
            if refusal is not None:  # before dialling: a stale KVReady reaches no one
                self._stats.refused_peers += 1
                raise refusal
            old = self._peers.get(md.name)
            if old is not None and old.alive and old.instance_id == md.instance_id:
                return
        if old is not None:
            self._drop_peer(old, f"peer {md.name!r} was replaced by a new instance")
        diff, message = self._compat.mismatch(md.protocol_version, md.compat_hash, md.compat_fields)
        if diff:
            raise HandshakeError(md.name, message, tuple(diff))
        self._channel.note_handshake()
        sock = self._channel.dealer()
        try:
            reply = exchange_hello(
                sock, self._hello, md, self._cfg.handshake_timeout_s, self._cfg.max_frame_bytes
            )
            region, dlist, plan, ranks = open_peer(
                self._nixl, md.name, reply, self._cfg.warmup, self._cfg.handshake_timeout_s
            )
        except BaseException:
            quietly(sock.close)
            raise
        peer = PeerOut(md.name, md.instance_id, md.endpoint, sock, region, dlist, plan=plan)
        peer.ranks = ranks
        if self._ranks is not None:
            try:
                self._ranks.connect(md.name, reply)
            except BaseException:
                self._forget_nixl(peer)
                quietly(sock.close)
                raise
        with self._lock:
            self._peers[md.name] = peer
            self._stats.handshakes += 1
        self._channel.adopt(sock, md.name)

    def set_policy(self, policy: PeerPolicy) -> None:
        """A new allowed map: drop (fail the reads of) every sender it does not allow."""
        with self._lock:
            self._policy = policy
            gone = [p for p in self._peers.values() if not policy.allows(p.name, p.instance_id)]
        for peer in gone:
            why = policy.refusal(self._hello.name, peer.name, peer.instance_id)
            self._drop_peer(peer, why.reason if why is not None else "no longer allowed")

    # ------------------------------------------------------------------ reads

    def start_read(
        self,
        request_id: str,
        peer_name: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        lease_deadline: float,
        sender_instance: str | None = None,
    ) -> None:
        """Queue the pinning renewal, then post the first chunk (see the module docstring)."""
        local = check_block_ids(request_id, local_block_ids, self._region.num_blocks)
        if not isinstance(lease_deadline, int | float) or not math.isfinite(lease_deadline):
            raise TransferError(request_id, "lease_deadline must be a finite unix time")
        with self._lock:
            peer = self._peer_for(request_id, peer_name, sender_instance)
            remote = check_block_ids(request_id, remote_block_ids, peer.region.num_blocks)
            if len(remote) != len(local):
                raise TransferError(
                    request_id, f"{len(remote)} remote blocks but {len(local)} local blocks"
                )
            now = time.monotonic()
            pairs = zip(
                chunk(list(remote), self._blocks_per_chunk),
                chunk(list(local), self._blocks_per_chunk),
                strict=True,
            )
            # Another TP layout: a READ per head slice, rank 0's last (it carries the notif).
            pieces = [None] if peer.plan is None else list(peer.plan.slices)
            pairs = [(r, lo, piece) for r, lo in pairs for piece in pieces]
            read = Read(
                request_id,
                peer_name,
                local,
                pairs,
                lease_until=now + (lease_deadline - time.time()),
                started_at=now,
                num_bytes=len(local) * self._region.bytes_per_block,
            )
            self._reads[request_id] = read
            if not self._may_post(
                read, peer, now, "the lease had expired before the READ could start"
            ):
                return
            if self._renews:  # off only under the never_read fault
                self._outgoing.append((peer_name, [request_id]))
        self._channel.wake()  # the renewal goes out while the first chunk is being posted
        if self._ranks is None:
            self._post_next_chunk(read)
            return
        read.ranks_out = True  # the other ranks READ first; rank 0's READs once they landed
        self._on_ranks(read, self._ranks.start(request_id, peer_name, list(remote), list(local)))

    def _on_ranks(self, read: Read, state: str) -> None:
        """What the other ranks said of their READs of `read` (tp_read.RankReads)."""
        if read.status.state is TransferState.FAILED:
            return
        if state == "DONE":
            read.ranks_out = False
            read.num_bytes += self._ranks.landed_bytes(read.request_id)
            self._post_next_chunk(read)
        elif state.startswith("ERR"):
            self._fail_from_nixl(read, f"a rank's READ failed: {state[4:]}", state)
        elif time.monotonic() - read.started_at > self._cfg.read_timeout_s:
            with self._lock:
                why = f"the ranks' READs still running after {self._cfg.read_timeout_s}s"
                self._fail(read, why, tell_sender=True)

    def _peer_for(self, request_id: str, name: str, instance: str | None) -> PeerOut:
        """The connected sender a new read may use (caller holds _lock), else TransferError."""
        if request_id in self._reads:
            raise TransferError(request_id, "a read of this request is in progress")
        peer = self._peers.get(name)
        if peer is None:
            raise TransferError(request_id, f"not connected to {name!r}: connect() to it first")
        if instance is not None and instance != peer.instance_id:
            # Its block ids name memory of an old (or other) incarnation: never read them.
            raise TransferError(
                request_id,
                f"its KV is on instance {instance} of {name!r}, connected to instance "
                f"{peer.instance_id}",
            )
        return peer

    def _may_post(self, read: Read, peer: PeerOut | None, now: float, expired: str) -> bool:
        """Whether a READ of `read` may be posted now; if not, fail it (caller holds _lock).
        A lease this close to its end may lapse before the READ lands: the sender is told
        to free the blocks at once."""
        if peer is None or not peer.alive:
            reason = peer.dead_reason if peer else "disconnected"
            self._fail(read, f"peer {read.peer!r} is down: {reason}")
            return False
        if read.lease_until <= now + _LEASE_MARGIN_S:
            self._fail(read, expired, tell_sender=True)
            return False
        return True

    def _post_next_chunk(self, read: Read) -> None:
        """Post the next READ of `read` (caller does not hold _lock)."""
        with self._lock:
            if read.status.state is TransferState.FAILED:
                return
            peer = self._peers.get(read.peer)
            if not self._may_post(
                read, peer, time.monotonic(), "the lease expired before the next READ could start"
            ):
                return
            remote_ids, local_ids, piece = read.chunks[read.next_chunk]
            last = read.next_chunk == len(read.chunks) - 1
        notif = encode(ReadComplete(read.request_id)) if last else b""
        try:
            if piece is None:
                handle = self._nixl.make_read(local_ids, peer.dlist, peer.region, remote_ids, notif)
            else:
                mine, theirs = peer.plan.rows(piece, remote_ids, local_ids)
                source = peer.plan.sources[piece.src_rank].name
                handle = self._nixl.make_rows_read(mine, theirs, source, notif)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error classes
            with self._lock:
                self._fail(read, f"could not create the READ: {e}")
            return
        with self._lock:
            read.handle = handle
            if read.status.state is TransferState.PENDING:
                read.status.advance(TransferState.TRANSFERRING)
        # On CPU, UCX may copy inside transfer(); _lock stays free so renewals keep flowing.
        state = self._post(handle)
        if state.startswith("ERR"):
            self._fail_from_nixl(read, f"NIXL could not post the READ: {state}", state)

    def advance(self) -> None:
        """One step of every read (the worker's poll())."""
        with self._lock:
            reads = list(self._reads.values())
        ranks = [r for r in reads if r.ranks_out and r.status.state is not TransferState.FAILED]
        if ranks:  # one order to the ranks for every read waiting on them
            states = self._ranks.poll([r.request_id for r in ranks])
            for read in ranks:
                self._on_ranks(read, states.get(read.request_id, "PROC"))
        for read in reads:
            self._advance(read)

    def _advance(self, read: Read) -> None:
        now = time.monotonic()  # per read: posting a chunk may copy for milliseconds
        if read.status.state is not TransferState.FAILED:
            if read.ranks_out:
                return  # the other ranks' READs have not landed yet
            step = self._step_chunk(read, now) if read.handle is not None else "landed"
            if step == "busy" or (step == "landed" and self._conclude(read, now)):
                return
        self._settle_failed(read)

    def _step_chunk(self, read: Read, now: float) -> Literal["busy", "failed", "landed"]:
        """Check the chunk in flight; post the next when it landed."""
        state = self._check(read.handle)
        if state == "PROC":
            if now - read.started_at <= self._cfg.read_timeout_s:
                return "busy"
            with self._lock:
                self._fail(
                    read, f"READ still running after {self._cfg.read_timeout_s}s", tell_sender=True
                )
            return "failed"
        if state != "DONE":
            self._fail_from_nixl(read, f"NIXL READ failed: {state}", state)
            return "failed"
        self._release_handle(read)
        read.next_chunk += 1
        if read.next_chunk == len(read.chunks):
            return "landed"
        self._post_next_chunk(read)
        return "failed" if read.status.state is TransferState.FAILED else "busy"

    def _conclude(self, read: Read, now: float) -> bool:
        """Every chunk landed: DONE if the sender confirmed the lease in time. Returns False
        when the read is FAILED and must be settled."""
        with self._lock:
            if read.status.state is TransferState.FAILED:
                return False
            if read.landed_at is None:
                read.landed_at = now
            if not read.acked:
                if now - read.started_at <= self._cfg.read_timeout_s:
                    return True  # wait for the sender's confirmation
                self._fail(read, "the sender never confirmed it held the blocks", tell_sender=True)
                return False
            if read.landed_at >= read.lease_until:
                # The sender may have reused the blocks while we read: never use this KV.
                self._fail(read, "the lease expired before the READ landed", tell_sender=True)
                return False
            read.status.advance(TransferState.DONE)
            seconds = read.landed_at - read.started_at
            self._stats.transfers += 1
            self._stats.bytes_read += read.num_bytes
            self._stats.seconds += seconds
            confirmed = read.acked_at - read.started_at
            done = ReadDone(read.request_id, read.local_ids, read.num_bytes, seconds, confirmed)
            self._events.append(done)
            del self._reads[read.request_id]
            return True

    def _settle_failed(self, read: Read) -> None:
        """Report a FAILED read once its READ can no longer land (handle released)."""
        if read.ranks_out:  # nor any of the other ranks' READs
            if not self._ranks.cancel(read.request_id):
                return  # retried at the next poll
            read.ranks_out = False
        if read.handle is not None and not self._release_handle(read):
            with self._lock:
                peer = self._peers.get(read.peer)
            if peer is None or peer.alive:
                return  # still cancelling; retried at the next poll
            # A dead peer sends nothing more; disconnecting lets NIXL drop the request.
            self._forget_nixl(peer)
            if not self._release_handle(read):
                log.error("READ handle of %s could not be released", read.request_id)
                return
        with self._lock:
            if self._reads.pop(read.request_id, None) is None:
                return
            if read.aborted:
                self._stats.aborted += 1
            else:
                self._stats.failures += 1
            peer = self._peers.get(read.peer)
            if read.tell_sender and peer is not None and peer.alive:
                self._outgoing.append((read.peer, Abort(read.request_id, read.status.reason or "")))
            self._events.append(
                ReadFailed(read.request_id, read.local_ids, read.status.reason or "failed")
            )
        self._channel.wake()

    def abort(self, request_id: str, peer_name: str | None) -> bool:
        """Cancel a read (ReadFailed "aborted" follows); returns whether one was running.
        With no read but a `peer_name`, tell that sender to free its blocks now."""
        with self._lock:
            read = self._reads.get(request_id)
            if read is not None and not read.status.state.terminal:
                read.aborted = True
                self._fail(read, "aborted", tell_sender=True)
                return True
            if peer_name in self._peers:
                self._outgoing.append((peer_name, Abort(request_id, "aborted by receiver")))
            return False

    def transfer_state(self, request_id: str) -> TransferState | None:
        with self._lock:
            read = self._reads.get(request_id)
            return None if read is None else read.status.state

    def take_events(self) -> list[TransferEvent]:
        with self._lock:
            events, self._events = self._events, []
            return events

    def stats(self) -> TransferStats:
        with self._lock:
            return dataclasses.replace(self._stats)

    def close(self) -> None:
        """Cancel every READ and forget every sender (the side-channel thread has stopped)."""
        for read in list(self._reads.values()):
            if read.handle is not None:
                self._release_handle(read)
        for peer in list(self._peers.values()):
            self._forget_nixl(peer)
        self._peers.clear()

    # ------------------------------------------------------------------ side-channel thread

    def busy(self) -> bool:
        with self._lock:
            return bool(self._reads)

    def on_frames(self, name: str, sock: zmq.Socket, frames: list[Any]) -> None:
        """Valid frames from the sender `name` on `sock` (its DEALER)."""
        with self._lock:
            peer = self._peers.get(name)
            if peer is None or peer.sock is not sock:
                return  # a replaced connection's leftovers
            for frame in frames:
                peer.awaiting_since = None  # any valid frame proves the sender is alive
                if isinstance(frame, RenewReply):
                    self._on_renew_reply(peer, frame)
                elif isinstance(frame, Abort):
                    read = self._reads.get(frame.request_id)
                    if read is not None and read.peer == name and not read.status.state.terminal:
                        read.aborted = True
                        # Echo so a sender waiting on a pinned lease frees it once we let go.
                        self._fail(
                            read, f"aborted by the sender ({frame.reason})", tell_sender=True
                        )
                elif isinstance(frame, ErrorReply):
                    log.warning("side channel: %s says %s", name, frame.message)

    def _on_renew_reply(self, peer: PeerOut, reply: RenewReply) -> None:
        sent = peer.sent_at.pop(reply.seq, None)
        for rid, status, remaining in zip(
            reply.request_ids, reply.statuses, reply.remaining_s, strict=True
        ):
            read = self._reads.get(rid)
            if read is None or read.peer != peer.name or read.status.state.terminal:
                continue
            if read.acked_at is None and status in ("ok", "done"):
                read.acked_at = time.monotonic()
            if status == "ok":
                if sent is not None:  # measured from our send: never later than the sender's
                    read.lease_until = sent + remaining
            elif status == "done":
                read.lease_until = math.inf
            else:
                self._fail(read, f"the sender reports the lease {status}")

    def beat(self, now: float) -> None:
        """Renew every active read's lease; declare silent senders dead."""
        if not self._renews:  # the never_read fault: the sender must see silence
            return
        with self._lock:
            active: dict[str, list[str]] = collections.defaultdict(list)
            for read in self._reads.values():
                if not read.status.state.terminal:
                    active[read.peer].append(read.request_id)
            for peer in self._peers.values():
                if peer.name not in active:
                    peer.awaiting_since = None  # idle: silence is not a failure
                    peer.sent_at.clear()
            for name, rids in active.items():
                peer = self._peers.get(name)
                if peer is None or not peer.alive:
                    continue
                timeout_s = self._cfg.peer_timeout_s
                if peer.awaiting_since is not None and now - peer.awaiting_since > timeout_s:
                    self._peer_down(peer, f"no answer on the side channel for {timeout_s}s")
                    continue
                self._outgoing.append((name, rids))

    def take_outgoing(self) -> list[tuple[zmq.Socket, Any]]:
        """Frames to send now, with the socket of each live sender. A renewal's send time is
        stamped here, just before it goes out: deadlines are measured from it."""
        out: list[tuple[zmq.Socket, Any]] = []
        with self._lock:
            pending, self._outgoing = self._outgoing, []
            now = time.monotonic()
            for name, item in pending:
                peer = self._peers.get(name)
                if peer is None or not peer.alive:
                    continue
                if isinstance(item, Abort):
                    out.append((peer.sock, item))
                    continue
                for start in range(0, max(1, len(item)), MAX_RIDS_PER_RENEW):
                    peer.seq += 1
                    peer.sent_at[peer.seq] = now
                    while len(peer.sent_at) > _MAX_UNANSWERED:
                        peer.sent_at.pop(next(iter(peer.sent_at)))
                    if peer.awaiting_since is None:
                        peer.awaiting_since = now
                    out.append(
                        (peer.sock, Renew(peer.seq, item[start : start + MAX_RIDS_PER_RENEW]))
                    )
        return out

    # ------------------------------------------------------------------ failures

    def _fail(self, read: Read, reason: str, tell_sender: bool = False) -> None:
        """Mark a read FAILED (caller holds _lock); poll() settles and reports it."""
        if read.status.state.terminal:
            return
        read.status.fail(reason)
        read.tell_sender = tell_sender

    def _fail_from_nixl(self, read: Read, reason: str, state: str) -> None:
        """A NIXL error fails the read; a dropped connection also marks its sender down. A
        live sender is told to free the blocks once the handle is released (no READ can land
        then), rather than hold them to the lease's end."""
        with self._lock:
            self._fail(read, reason, tell_sender=True)
            peer = self._peers.get(read.peer)
            if peer is not None and peer.alive and "DISCONNECT" in state.upper():
                self._peer_down(peer, "its NIXL connection dropped")

    def _peer_down(self, peer: PeerOut, reason: str) -> None:
        """Caller holds _lock: a sender is gone; every read from it fails."""
        peer.alive = False
        peer.dead_reason = reason
        for read in self._reads.values():
            if read.peer == peer.name:
                self._fail(read, f"peer {peer.name!r} failed: {reason}")

    def _drop_peer(self, peer: PeerOut, reason: str) -> None:
        with self._lock:
            self._peer_down(peer, reason)
            reads = [r for r in self._reads.values() if r.peer == peer.name]
        for read in reads:
            self._settle_failed(read)
        self._forget_nixl(peer)
        with self._lock:
            self._peers.pop(peer.name, None)
        self._channel.retire(peer.sock)

    def _forget_nixl(self, peer: PeerOut) -> None:
        if peer.dlist is not None:
            self._nixl.forget_peer(peer.name, peer.dlist)
            peer.dlist = None
        while peer.ranks:  # its other ranks' agents (a TP sender), each forgotten once
            self._nixl.forget_peer(peer.ranks.pop(), None)
        if self._ranks is not None:
            self._ranks.forget(peer.name)

    def _release_handle(self, read: Read) -> bool:
        if not self._release_xfer(read.handle, read.request_id):
            return False
        read.handle = None
        return True
