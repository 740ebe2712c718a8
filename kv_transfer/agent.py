"""KVTransferAgent: one NIXL agent per worker, moving paged KV blocks by pull (receiver READs).

Lifecycle of one request, sender (prefill worker) and receiver (decode worker):

    sender                                        receiver
    hold(rid, blocks, peer) -> lease deadline     (KVReady travels on the workers' socket)
                                                  connect(sender metadata)   once per pair
                                                  start_read(rid, ...)       PENDING
      Renew{rid} <------------------------------  pin + renew, every heartbeat_s
      pin lease, extend deadline  -------------> RenewReply ok/remaining       TRANSFERRING
                      <== NIXL READ (chunks) ===
      NIXL notif ReadComplete{rid} <-----------  sent with the last chunk
    poll() -> Released(read_done)                 poll() -> ReadDone             DONE
                                                  (only once the READ landed AND the sender
                                                   confirmed it held the blocks throughout)

Failure paths: the lease runs out (sender: Released lease_expired / peer_failed when the reader
had pinned it), abort on either side (Abort on the side channel; Released/ReadFailed aborted),
a dead or hung sender (NIXL error, or no RenewReply for peer_timeout_s: ReadFailed), a READ
longer than read_timeout_s (ReadFailed). Events come out of `poll()` only once no READ can
touch the blocks any more, so the worker may free or reuse them at once.

Threads: the worker thread calls the public methods; a small side-channel thread owns the
ZMQ sockets, so handshakes and lease renewals are answered while the worker is busy in a
forward pass, and takes NIXL notifications (which progresses UCX, NIXL's own spinning
progress thread being off). They share state under `_lock` and NIXL under `_nixl_lock`; the
side-channel thread never touches the engine.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Self

import numpy as np
import torch
import zmq

from engine.kv_cache import KVCache
from engine.wire import WireError, decode, encode
from kv_transfer.descriptors import BlockRegion, chunk
from kv_transfer.errors import (
    HandshakeError,
    TransferError,
    describe_differences,
    differing_fields,
)
from kv_transfer.events import ReadDone, ReadFailed, Released, TransferEvent, TransferStats
from kv_transfer.messages import (
    MAX_NOTIF_BYTES,
    MAX_RIDS_PER_RENEW,
    MAX_SIDE_FRAME_BYTES,
    PROTOCOL_VERSION,
    Abort,
    AgentMetadata,
    ErrorReply,
    Hello,
    HelloReply,
    ReadComplete,
    Renew,
    RenewReply,
)
from kv_transfer.state import TransferState, TransferStatus

log = logging.getLogger(__name__)

_TOMBSTONES = 8192  # recently finished sender-side requests, to answer late renewals truthfully
_LEASE_MARGIN_S = 0.05  # never start a READ this close to the lease's end


@dataclass(slots=True)
class _Lease:
    """Sender side: blocks held for one peer until `expires_at` (monotonic)."""

    request_id: str
    block_ids: tuple[int, ...]
    peer: str
    expires_at: float
    pinned: bool = False  # the reader said it is reading: free only on notif/abort/expiry
    abort_pending: bool = False  # aborted here while pinned: waiting for the reader to let go


@dataclass(slots=True)
class _PeerIn:
    """Sender side: a receiver that handshook on our ROUTER."""

    name: str
    instance_id: str
    identity: bytes


@dataclass(slots=True)
class _PeerOut:
    """Receiver side: a sender we READ from."""

    name: str
    instance_id: str
    endpoint: str
    sock: zmq.Socket
    region: BlockRegion
    dlist: Any  # NIXL prepped remote descriptor list
    alive: bool = True
    dead_reason: str = ""
    seq: int = 0
    sent_at: dict[int, float] = field(default_factory=dict)  # renew seq -> monotonic send time
    awaiting_since: float | None = None  # oldest unanswered renew


@dataclass(slots=True)
class _Read:
    """Receiver side: one request's pull."""

    request_id: str
    peer: str
    local_ids: tuple[int, ...]
    chunks: list[tuple[list[int], list[int]]]  # (remote ids, local ids) per READ
    lease_until: float  # monotonic; from KVReady, then from the sender's renew replies
    started_at: float
    num_bytes: int
    status: TransferStatus = field(default_factory=TransferStatus)
    next_chunk: int = 0
    handle: Any = None  # NIXL xfer handle of the chunk in flight
    acked: bool = False  # the sender confirmed the blocks were held (pinned) for us
    landed_at: float | None = None
    tell_sender: bool = False  # on failure, send Abort so the sender frees at once
    aborted: bool = False


class KVTransferAgent:
    """Moves KV blocks between workers' caches with NIXL; see the module docstring."""

    def __init__(
        self,
        name: str,
        kv_cache: KVCache,
        bind_host: str = "127.0.0.1",
        lease_seconds: float = 10.0,
        read_timeout_s: float = 30.0,
        *,
        peer_timeout_s: float = 3.0,
        heartbeat_s: float | None = None,
        handshake_timeout_s: float = 5.0,
        max_read_bytes: int = 64 << 20,
        max_frame_bytes: int = MAX_SIDE_FRAME_BYTES,
        warmup: bool = True,
        advertise_host: str | None = None,
        progress_thread: bool = False,
    ):
        if not isinstance(name, str) or not name or len(name) > 200:
            raise ValueError("name must be a non-empty string of at most 200 chars")
        for label, value in (("lease_seconds", lease_seconds), ("read_timeout_s", read_timeout_s),
                             ("peer_timeout_s", peer_timeout_s),
                             ("handshake_timeout_s", handshake_timeout_s)):
            if not value > 0:
                raise ValueError(f"{label} must be > 0, got {value}")
        # Renew well inside the lease so one lost beat never lets it lapse under a live reader.
        heartbeat_s = min(0.5, lease_seconds / 4) if heartbeat_s is None else heartbeat_s
        if not 0 < heartbeat_s < lease_seconds / 2 or heartbeat_s >= peer_timeout_s:
            raise ValueError("heartbeat_s must be > 0, < lease_seconds/2 and < peer_timeout_s")
        if max_read_bytes < 1 or max_frame_bytes < 1024:
            raise ValueError("max_read_bytes must be >= 1 and max_frame_bytes >= 1024")
        from nixl._api import nixl_agent, nixl_agent_config  # heavy; imported on first use

        self.name = name
        self.kv_cache = kv_cache
        self.spec = kv_cache.spec
        self.lease_seconds = float(lease_seconds)
        self.read_timeout_s = float(read_timeout_s)
        self.peer_timeout_s = float(peer_timeout_s)
        self.heartbeat_s = float(heartbeat_s)
        self.handshake_timeout_s = float(handshake_timeout_s)
        self.max_read_bytes = int(max_read_bytes)
        self.max_frame_bytes = int(max_frame_bytes)
        self.instance_id = uuid.uuid4().hex
        self._compat = self.spec.compat_fields()
        self._compat_hash = self.spec.compat_hash()
        self._warmup_enabled = warmup

        # --- NIXL: register the cache (and FP8 scales) once; prep every block's descriptor.
        # NIXL's own progress thread polls UCX without sleeping and keeps a core busy even
        # when idle (measured: ~40-50% of a core per agent, and a 3x slower 16 MB READ on a
        # 2-core box). Off by default: the side-channel thread drives progress instead (every
        # 2 ms while transfers or handshakes are under way), serialized with the worker
        # thread's NIXL calls by _nixl_lock.
        self._nixl_lock = threading.RLock()
        self._nixl = _Serialized(
            nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread,
                                               backends=["UCX"])),
            self._nixl_lock,
        )
        dev = kv_cache.device
        self._mem_type = "VRAM" if dev.type == "cuda" else "DRAM"
        dev_id = (dev.index or 0) if dev.type == "cuda" else 0
        for t in (kv_cache.data, kv_cache.scales):
            if t is not None and not t.is_contiguous():
                raise ValueError("the KV cache tensors must be contiguous to be registered")
        self._regs = [self._nixl.register_memory(kv_cache.data)]
        if kv_cache.scales is not None:
            self._regs.append(self._nixl.register_memory(kv_cache.scales))
        # Warm-up target: reading a peer's block 0 must not touch a live block of ours.
        self._scratch = torch.empty(self.spec.block_bytes, dtype=torch.uint8, device=dev)
        self._regs.append(self._nixl.register_memory(self._scratch))
        self.region = BlockRegion(
            mem_type=self._mem_type,
            device_id=dev_id,
            num_blocks=kv_cache.num_blocks,
            data_base=kv_cache.data.data_ptr(),
            block_bytes=self.spec.block_bytes,
            scales_base=kv_cache.scales.data_ptr() if kv_cache.scales is not None else 0,
            scale_block_bytes=self.spec.scale_block_bytes,
        )
        self._local_dlist = self._nixl.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self.region.descriptors(), self._mem_type
        )
        scratch_row = np.array(
            [[self._scratch.data_ptr(), self.spec.block_bytes, dev_id]], dtype=np.uint64
        )
        self._scratch_dlist = self._nixl.prep_xfer_dlist(
            "NIXL_INIT_AGENT", scratch_row, self._mem_type
        )
        self._nixl_md = self._nixl.get_agent_metadata()
        self._blocks_per_chunk = max(1, self.max_read_bytes // self.region.bytes_per_block)

        # --- state shared with the side-channel thread
        self._lock = threading.Lock()
        self._api_lock = threading.RLock()  # serializes public calls (and so NIXL calls)
        self._leases: dict[str, _Lease] = {}
        self._tombstones: collections.OrderedDict[str, tuple[str, str]] = (
            collections.OrderedDict()
        )
        self._peers_in: dict[bytes, _PeerIn] = {}
        self._ident_by_name: dict[str, bytes] = {}
        self._peers_out: dict[str, _PeerOut] = {}
        self._reads: dict[str, _Read] = {}
        self._events: list[TransferEvent] = []
        self._stats = TransferStats()
        self._outbox: collections.deque[tuple[str, Any, Any]] = collections.deque()
        self._new_socks: list[zmq.Socket] = []
        self._dead_socks: list[zmq.Socket] = []
        self._closed = False
        self._last_hello = 0.0  # monotonic time of the last handshake, either direction

        # --- side channel: a ROUTER bound on an OS-chosen port
        self._ctx = zmq.Context()
        self._router = self._socket(zmq.ROUTER)
        self._router.bind(f"tcp://{bind_host}:*")
        bound = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.endpoint = _advertised(bound, advertise_host)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(
            target=self._side_channel_loop, name=f"kvx-{name}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ public: both sides

    def metadata(self) -> dict:
        """What peers need to reach this agent (msgpack-able; for the registry and KVReady)."""
        return self.agent_metadata().to_dict()

    def agent_metadata(self) -> AgentMetadata:
        return AgentMetadata(
            name=self.name,
            instance_id=self.instance_id,
            endpoint=self.endpoint,
            protocol_version=PROTOCOL_VERSION,
            compat_hash=self._compat_hash,
            compat_fields=dict(self._compat),
            num_blocks=self.region.num_blocks,
            mem_type=self._mem_type,
        )

    def poll(self) -> list[TransferEvent]:
        """Advance transfers and return what finished; call it every worker-loop iteration."""
        with self._api_lock:
            self._check_open()
            now = time.monotonic()
            self._poll_notifs()
            with self._lock:
                self._expire_leases(now)
                reads = list(self._reads.values())
            for read in reads:
                self._advance(read)
            with self._lock:
                events, self._events = self._events, []
            return events

    def abort(self, request_id: str, peer_name: str | None = None) -> bool:
        """Give up `request_id` on this side and tell the peer; returns whether it was known.

        Sender: the lease is released at once (Released "aborted" at the next poll), or, if the
        reader already pinned it, once the reader lets go. Receiver: the READ is cancelled and
        ReadFailed "aborted" follows. `peer_name` lets a receiver that never started the READ
        still tell the sender to free its blocks now rather than at lease expiry.
        """
        with self._api_lock, self._lock:
            known = False
            lease = self._leases.get(request_id)
            if lease is not None:
                known = True
                ident = self._ident_by_name.get(lease.peer)
                if ident is not None:
                    self._outbox.append(("ident", ident, Abort(request_id, "aborted by sender")))
                if lease.pinned:
                    lease.abort_pending = True
                else:
                    self._release(lease, "aborted")
            read = self._reads.get(request_id)
            if read is not None and not read.status.state.terminal:
                known = True
                read.aborted = True
                self._fail(read, "aborted", tell_sender=True)
            if not known and peer_name in self._peers_out:
                self._outbox.append(("peer", peer_name, Abort(request_id, "aborted by receiver")))
        self._wake()
        return known

    def stats(self) -> TransferStats:
        with self._lock:
            return TransferStats(**{k: getattr(self._stats, k) for k in TransferStats.__slots__})

    def num_held(self) -> int:
        """Sender side: requests whose blocks are still held."""
        with self._lock:
            return len(self._leases)

    def transfer_state(self, request_id: str) -> TransferState | None:
        """Receiver side: the state of a request still tracked here (None once reported)."""
        with self._lock:
            read = self._reads.get(request_id)
            return None if read is None else read.status.state

    def close(self) -> None:
        with self._api_lock:
            if self._closed:
                return
            with self._lock:
                self._closed = True
            self._wake()
            self._thread.join(timeout=5)
            for read in list(self._reads.values()):
                if read.handle is not None:
                    self._release_handle(read)
            for peer in list(self._peers_out.values()):
                self._forget_peer_nixl(peer)
            with self._nixl_lock:
                for h in (self._local_dlist, self._scratch_dlist):
                    _quiet(h.release)
            for reg in self._regs:
                _quiet(lambda reg=reg: self._nixl.deregister_memory(reg))
            for s in [self._router, *[p.sock for p in self._peers_out.values()],
                      *self._new_socks, *self._dead_socks]:
                _quiet(s.close)
            self._ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._peers_out.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ public: sender

    def hold(self, request_id: str, block_ids: list[int], peer_name: str) -> float:
        """Hold `block_ids` for `peer_name` to read; returns the lease deadline (unix seconds)."""
        ids = self._check_block_ids(request_id, block_ids, self.region.num_blocks)
        if not isinstance(peer_name, str) or not peer_name:
            raise TransferError(request_id, "peer_name must be a non-empty string")
        with self._api_lock, self._lock:
            self._check_open()
            if request_id in self._leases:
                raise TransferError(request_id, "its blocks are already held")
            self._tombstones.pop(request_id, None)
            self._leases[request_id] = _Lease(
                request_id, ids, peer_name, time.monotonic() + self.lease_seconds
            )
            return time.time() + self.lease_seconds

    # ------------------------------------------------------------------ public: receiver

    def connect(self, peer_metadata: AgentMetadata | dict) -> None:
        """Handshake with a sender once (idempotent per peer instance); raise HandshakeError
        naming the differing fields when the layouts do not match. Nothing is transferred
        to or from a peer that is refused."""
        try:
            md = AgentMetadata.coerce(peer_metadata)
        except (ValueError, TypeError) as e:
            name = peer_metadata.get("name", "?") if isinstance(peer_metadata, dict) else "?"
            raise HandshakeError(str(name), f"malformed peer metadata: {e}") from e
        with self._api_lock:
            self._check_open()
            with self._lock:
                old = self._peers_out.get(md.name)
                if old is not None and old.alive and old.instance_id == md.instance_id:
                    return
            if old is not None:
                self._drop_peer(old, f"peer {md.name!r} was replaced by a new instance")
            self._check_compat(md.name, md.protocol_version, md.compat_hash, md.compat_fields)
            self._last_hello = time.monotonic()
            sock = self._socket(zmq.DEALER)
            added: str | None = None
            try:
                sock.connect(md.endpoint)
                sock.send(encode(Hello(PROTOCOL_VERSION, self.name, self.instance_id,
                                       self._compat_hash, dict(self._compat), self.endpoint)))
                if not sock.poll(int(self.handshake_timeout_s * 1000)):
                    raise HandshakeError(
                        md.name, f"no answer from {md.endpoint} within {self.handshake_timeout_s}s"
                    )
                try:
                    reply = decode(sock.recv(), self.max_frame_bytes, expect=HelloReply)
                except WireError as e:
                    raise HandshakeError(md.name, f"malformed reply: {e}") from e
                if not reply.ok:
                    raise HandshakeError(md.name, reply.error, tuple(reply.differing_fields))
                if reply.name != md.name or reply.instance_id != md.instance_id:
                    raise HandshakeError(md.name, f"{md.endpoint} is now {reply.name!r} "
                                                  f"(instance {reply.instance_id})")
                region = BlockRegion(reply.mem_type, reply.device_id, reply.num_blocks,
                                     reply.data_base, reply.block_bytes, reply.scales_base,
                                     reply.scale_block_bytes)
                if (region.block_bytes, region.scale_block_bytes) != (
                    self.region.block_bytes, self.region.scale_block_bytes
                ):
                    raise HandshakeError(md.name, "block byte sizes differ", ("block_bytes",))
                loaded = self._nixl.add_remote_agent(reply.nixl_metadata)
                added = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
                if added != md.name:
                    raise HandshakeError(md.name, f"its NIXL metadata names {added!r}")
                dlist = self._nixl.prep_xfer_dlist(md.name, region.descriptors(), region.mem_type)
                peer = _PeerOut(md.name, md.instance_id, md.endpoint, sock, region, dlist)
                if self._warmup_enabled:
                    self._warm_up(peer)
            except BaseException:
                _quiet(sock.close)
                if added is not None:
                    _quiet(lambda: self._nixl.remove_remote_agent(added))
                raise
            with self._lock:
                self._peers_out[md.name] = peer
                self._new_socks.append(sock)
                self._stats.handshakes += 1
            self._wake()

    def start_read(
        self,
        request_id: str,
        peer_name: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        lease_deadline: float,
    ) -> None:
        """Start pulling `remote_block_ids` of `peer_name` into `local_block_ids` (allocated by
        the caller). The outcome arrives from poll() as ReadDone or ReadFailed; a lease already
        known to have expired never starts a READ (ReadFailed at the next poll).

        Raises TransferError for a call that cannot be honoured at all (unknown peer, bad ids,
        a request already in progress)."""
        local = self._check_block_ids(request_id, local_block_ids, self.region.num_blocks)
        if not isinstance(lease_deadline, int | float) or not math.isfinite(lease_deadline):
            raise TransferError(request_id, "lease_deadline must be a finite unix time")
        with self._api_lock:
            self._check_open()
            with self._lock:
                if request_id in self._reads:
                    raise TransferError(request_id, "a read of this request is in progress")
                peer = self._peers_out.get(peer_name)
                if peer is None:
                    raise TransferError(
                        request_id, f"not connected to {peer_name!r}: connect() to it first"
                    )
                remote = self._check_block_ids(request_id, remote_block_ids,
                                               peer.region.num_blocks)
                if len(remote) != len(local):
                    raise TransferError(request_id, f"{len(remote)} remote blocks but "
                                                    f"{len(local)} local blocks")
                now = time.monotonic()
                pairs = list(zip(chunk(list(remote), self._blocks_per_chunk),
                                 chunk(list(local), self._blocks_per_chunk), strict=True))
                read = _Read(request_id, peer_name, local, pairs,
                             lease_until=now + (lease_deadline - time.time()), started_at=now,
                             num_bytes=len(local) * self.region.bytes_per_block)
                self._reads[request_id] = read
                if not peer.alive:
                    self._fail(read, f"peer {peer_name!r} is down: {peer.dead_reason}")
                    return
                if read.lease_until <= now + _LEASE_MARGIN_S:
                    self._fail(read, "the lease had expired before the READ could start",
                               tell_sender=True)
                    return
                self._outbox.append(("renew", peer_name, [request_id]))
            self._wake()
            self._post_next_chunk(read)

    # ------------------------------------------------------------------ receiver internals

    def _warm_up(self, peer: _PeerOut) -> None:
        """One 1-block READ into scratch memory: pays UCX's connection setup (~0.4 s on a
        fresh pair) at handshake time instead of on the first request."""
        handle = self._nixl.make_prepped_xfer(
            "READ", self._scratch_dlist, [0], peer.dlist, [0], b""
        )
        try:
            state = self._nixl.transfer(handle)
            deadline = time.monotonic() + self.handshake_timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(0.0005)
                state = self._nixl.check_xfer_state(handle)
            if state != "DONE":
                raise HandshakeError(peer.name, f"warm-up READ ended {state}")
        except HandshakeError:
            raise
        except Exception as e:  # NIXL raises its own error classes
            raise HandshakeError(peer.name, f"warm-up READ failed: {e}") from e
        finally:
            with self._nixl_lock:
                _quiet(handle.release)

    def _post_next_chunk(self, read: _Read) -> None:
        """Post the next READ of `read` (caller holds _api_lock, not _lock)."""
        with self._lock:
            if read.status.state is TransferState.FAILED:
                return
            now = time.monotonic()
            if now >= read.lease_until - _LEASE_MARGIN_S:
                self._fail(read, "the lease expired before the next READ could start",
                           tell_sender=True)
                return
            peer = self._peers_out.get(read.peer)
            if peer is None or not peer.alive:
                reason = peer.dead_reason if peer else "disconnected"
                self._fail(read, f"peer {read.peer!r} is down: {reason}")
                return
            remote_ids, local_ids = read.chunks[read.next_chunk]
            last = read.next_chunk == len(read.chunks) - 1
        notif = encode(ReadComplete(read.request_id)) if last else b""
        try:
            handle = self._nixl.make_prepped_xfer(
                "READ", self._local_dlist, self.region.indices(local_ids),
                peer.dlist, peer.region.indices(remote_ids), notif,
            )
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error classes
            with self._lock:
                self._fail(read, f"could not create the READ: {e}")
            return
        with self._lock:
            read.handle = handle
            if read.status.state is TransferState.PENDING:
                read.status.advance(TransferState.TRANSFERRING)
        # On CPU, UCX may copy inside transfer(); _lock stays free so renewals keep flowing.
        try:
            state = self._nixl.transfer(handle)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error classes
            state = f"ERR ({e})"
        if state.startswith("ERR"):
            with self._lock:
                self._fail(read, f"NIXL could not post the READ: {state}")
                self._mark_dead_if_disconnected(peer, state)

    def _advance(self, read: _Read) -> None:
        """One step of a read's state machine (caller holds _api_lock, not _lock)."""
        now = time.monotonic()
        if read.status.state is TransferState.FAILED:
            self._settle_failed(read)
            return
        if read.handle is not None:
            try:
                state = self._nixl.check_xfer_state(read.handle)
            except Exception as e:  # noqa: BLE001 - e.g. nixlRemoteDisconnectError
                state = f"ERR ({e})"
            if state == "PROC":
                if now - read.started_at > self.read_timeout_s:
                    with self._lock:
                        self._fail(read, f"READ still running after {self.read_timeout_s}s",
                                   tell_sender=True)
                    self._settle_failed(read)
                return
            if state != "DONE":
                with self._lock:
                    self._fail(read, f"NIXL READ failed: {state}")
                    peer = self._peers_out.get(read.peer)
                    if peer is not None:
                        self._mark_dead_if_disconnected(peer, state)
                self._settle_failed(read)
                return
            self._release_handle(read)
            read.next_chunk += 1
            if read.next_chunk < len(read.chunks):
                self._post_next_chunk(read)
                if read.status.state is TransferState.FAILED:
                    self._settle_failed(read)
                return
        with self._lock:
            if read.status.state is TransferState.FAILED:
                pass
            elif read.landed_at is None:
                read.landed_at = now
            if read.status.state is not TransferState.FAILED:
                if not read.acked:
                    if now - read.started_at > self.read_timeout_s:
                        self._fail(read, "the sender never confirmed it held the blocks",
                                   tell_sender=True)
                    else:
                        return
                elif read.landed_at >= read.lease_until:
                    # The sender may have reused the blocks while we read: never use this KV.
                    self._fail(read, "the lease expired before the READ landed",
                               tell_sender=True)
                else:
                    read.status.advance(TransferState.DONE)
                    seconds = read.landed_at - read.started_at
                    self._stats.transfers += 1
                    self._stats.bytes_read += read.num_bytes
                    self._stats.seconds += seconds
                    self._events.append(
                        ReadDone(read.request_id, read.local_ids, read.num_bytes, seconds)
                    )
                    del self._reads[read.request_id]
                    return
        self._settle_failed(read)

    def _settle_failed(self, read: _Read) -> None:
        """Report a FAILED read once its READ can no longer land (handle released)."""
        if read.handle is not None and not self._release_handle(read):
            with self._lock:
                peer = self._peers_out.get(read.peer)
            if peer is None or peer.alive:
                return  # still cancelling; retried at the next poll
            # A dead peer sends nothing more; disconnecting lets NIXL drop the request.
            self._forget_peer_nixl(peer)
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
            peer = self._peers_out.get(read.peer)
            if read.tell_sender and peer is not None and peer.alive:
                self._outbox.append(("peer", read.peer, Abort(read.request_id,
                                                              read.status.reason or "")))
            self._events.append(
                ReadFailed(read.request_id, read.local_ids, read.status.reason or "failed")
            )
        self._wake()

    def _release_handle(self, read: _Read) -> bool:
        try:
            with self._nixl_lock:
                read.handle.release()
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error classes
            log.warning("releasing the READ of %s: %s", read.request_id, e)
            return False
        read.handle = None
        return True

    def _fail(self, read: _Read, reason: str, tell_sender: bool = False) -> None:
        """Mark a read FAILED (caller holds _lock); poll() settles and reports it."""
        if read.status.state.terminal:
            return
        read.status.fail(reason)
        read.tell_sender = tell_sender

    def _mark_dead_if_disconnected(self, peer: _PeerOut, state: str) -> None:
        if "DISCONNECT" in state.upper() and peer.alive:
            self._peer_down(peer, "its NIXL connection dropped")

    def _peer_down(self, peer: _PeerOut, reason: str) -> None:
        """Caller holds _lock: a sender is gone; every read from it fails."""
        peer.alive = False
        peer.dead_reason = reason
        for read in self._reads.values():
            if read.peer == peer.name:
                self._fail(read, f"peer {peer.name!r} failed: {reason}")

    def _drop_peer(self, peer: _PeerOut, reason: str) -> None:
        with self._lock:
            self._peer_down(peer, reason)
            reads = [r for r in self._reads.values() if r.peer == peer.name]
        for read in reads:
            self._settle_failed(read)
        self._forget_peer_nixl(peer)
        with self._lock:
            self._peers_out.pop(peer.name, None)
            self._dead_socks.append(peer.sock)
        self._wake()

    def _forget_peer_nixl(self, peer: _PeerOut) -> None:
        if peer.dlist is not None:
            with self._nixl_lock:
                _quiet(peer.dlist.release)
            peer.dlist = None
            _quiet(lambda: self._nixl.remove_remote_agent(peer.name))

    # ------------------------------------------------------------------ sender internals

    def _poll_notifs(self, wait: bool = True) -> None:
        """Take NIXL notifications (and so progress UCX). The side-channel thread passes
        wait=False: while the worker thread is inside a NIXL call (a CPU READ copies inside
        transfer()), that call progresses UCX itself, and the side channel must not stall
        behind it (the lease confirmation would otherwise wait for the copy to end)."""
        if not self._nixl_lock.acquire(blocking=wait):
            return
        try:
            notifs = self._nixl.get_new_notifs()
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error classes
            log.warning("reading NIXL notifications: %s", e)
            return
        finally:
            self._nixl_lock.release()
        with self._lock:
            for agent, msgs in notifs.items():
                agent = agent.decode() if isinstance(agent, bytes) else agent
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
                    self._stats.bytes_served += len(lease.block_ids) * self.region.bytes_per_block
                    self._release(lease, "aborted" if lease.abort_pending else "read_done")

    def _expire_leases(self, now: float) -> None:
        """Caller holds _lock."""
        for lease in [x for x in self._leases.values() if now >= x.expires_at]:
            self._expire(lease)

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
        """Caller holds _lock: the blocks go back to the worker at its next poll()."""
        del self._leases[lease.request_id]
        if reason == "aborted":
            self._stats.aborted += 1
        self._tombstones[lease.request_id] = (reason, lease.peer)
        while len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)
        self._events.append(Released(lease.request_id, lease.block_ids, reason))

    # ------------------------------------------------------------------ side channel

    def _side_channel_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        socks: dict[zmq.Socket, str] = {}
        next_beat = time.monotonic()
        while True:
            self._poll_notifs(wait=False)  # also drives UCX progress for peers reading from us
            with self._lock:
                if self._closed:
                    return
                for s in self._new_socks:
                    peer = next((p for p in self._peers_out.values() if p.sock is s), None)
                    if peer is not None:
                        socks[s] = peer.name
                        poller.register(s, zmq.POLLIN)
                self._new_socks.clear()
                for s in self._dead_socks:
                    if s in socks:
                        poller.unregister(s)
                        del socks[s]
                    _quiet(s.close)
                self._dead_socks.clear()
                self._flush_outbox()
                busy = (bool(self._reads) or any(x.pinned for x in self._leases.values())
                        or time.monotonic() - self._last_hello < 5.0)
            try:
                ready = dict(poller.poll(2 if busy else 100))
            except zmq.ZMQError:
                return
            if self._wake_r in ready:
                _drain(self._wake_r)
            with self._lock:
                if self._closed:
                    return
                if self._router in ready:
                    self._serve_router()
                for s, name in list(socks.items()):
                    if s in ready:
                        self._serve_peer(s, name)
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.heartbeat_s
                    self._beat(now)
                self._flush_outbox()

    def _flush_outbox(self) -> None:
        """Caller holds _lock and runs on the side-channel thread (the sockets' owner)."""
        while self._outbox:
            kind, target, msg = self._outbox.popleft()
            try:
                if kind == "ident":
                    self._router.send_multipart([target, encode(msg, self.max_frame_bytes)],
                                                zmq.NOBLOCK)
                    continue
                peer = self._peers_out.get(target)
                if peer is None or not peer.alive:
                    continue
                if kind == "renew":
                    self._send_renew(peer, msg)
                else:
                    peer.sock.send(encode(msg, self.max_frame_bytes), zmq.NOBLOCK)
            except (zmq.ZMQError, WireError) as e:
                log.warning("side channel: dropping a %s frame to %r: %s", kind, target, e)

    def _send_renew(self, peer: _PeerOut, rids: list[str]) -> None:
        now = time.monotonic()
        for start in range(0, max(1, len(rids)), MAX_RIDS_PER_RENEW):
            peer.seq += 1
            peer.sent_at[peer.seq] = now
            while len(peer.sent_at) > 1024:
                peer.sent_at.pop(next(iter(peer.sent_at)))
            if peer.awaiting_since is None:
                peer.awaiting_since = now
            frame = encode(Renew(peer.seq, rids[start:start + MAX_RIDS_PER_RENEW]))
            peer.sock.send(frame, zmq.NOBLOCK)

    def _beat(self, now: float) -> None:
        """Renew every active read's lease; declare silent senders dead (caller holds _lock)."""
        active: dict[str, list[str]] = collections.defaultdict(list)
        for read in self._reads.values():
            if not read.status.state.terminal:
                active[read.peer].append(read.request_id)
        for peer in self._peers_out.values():
            if peer.name not in active:
                peer.awaiting_since = None  # idle: silence is not a failure
                peer.sent_at.clear()
        for name, rids in active.items():
            peer = self._peers_out.get(name)
            if peer is None or not peer.alive:
                continue
            if peer.awaiting_since is not None and now - peer.awaiting_since > self.peer_timeout_s:
                self._peer_down(peer, f"no answer on the side channel for {self.peer_timeout_s}s")
                continue
            self._outbox.append(("renew", name, rids))

    def _recv_frames(self, sock: zmq.Socket) -> list[list[bytes]]:
        out = []
        for _ in range(256):  # bounded: other sockets and timers get their turn
            try:
                out.append(sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        return out

    def _serve_router(self) -> None:
        for msg in self._recv_frames(self._router):
            ident, body = msg[0], msg[1:]
            try:
                if len(body) != 1:
                    raise WireError(f"expected one frame, got {len(body)}")
                frame = decode(body[0], self.max_frame_bytes)
                reply = self._on_router_message(ident, frame)
            except WireError as e:
                self._stats.rejected_frames += 1
                log.warning("side channel: rejected a frame: %s", e)
                reply = ErrorReply(f"rejected: {e}"[:4000])
            if reply is not None:
                self._outbox.append(("ident", ident, reply))

    def _on_router_message(self, ident: bytes, msg: Any) -> Any:
        if isinstance(msg, Hello):
            return self._on_hello(ident, msg)
        peer = self._peers_in.get(ident)
        if peer is None:
            raise WireError(f"{type(msg).__name__} before a handshake")
        if isinstance(msg, Renew):
            return self._on_renew(peer, msg)
        if isinstance(msg, Abort):
            lease = self._leases.get(msg.request_id)
            if lease is not None and lease.peer == peer.name:
                self._release(lease, "aborted")
            return None
        raise WireError(f"unexpected {type(msg).__name__} on a sender's side channel")

    def _on_hello(self, ident: bytes, hello: Hello) -> HelloReply:
        self._last_hello = time.monotonic()  # the new peer's UCX wire-up needs our progress
        fields = self._compat_diff(hello.protocol_version, hello.compat_hash,
                                   hello.compat_fields)
        if fields:
            theirs = {**hello.compat_fields, "protocol_version": str(hello.protocol_version)}
            mine = {**self._compat, "protocol_version": str(PROTOCOL_VERSION)}
            return HelloReply(ok=False, name=self.name, instance_id=self.instance_id,
                              error=describe_differences(fields, theirs, mine),
                              differing_fields=fields)
        old = self._ident_by_name.get(hello.name)
        if old is not None and old != ident:
            self._peers_in.pop(old, None)
        self._peers_in[ident] = _PeerIn(hello.name, hello.instance_id, ident)
        self._ident_by_name[hello.name] = ident
        r = self.region
        return HelloReply(ok=True, name=self.name, instance_id=self.instance_id,
                          nixl_metadata=self._nixl_md, mem_type=r.mem_type,
                          device_id=r.device_id, num_blocks=r.num_blocks,
                          data_base=r.data_base, block_bytes=r.block_bytes,
                          scales_base=r.scales_base, scale_block_bytes=r.scale_block_bytes)

    def _on_renew(self, peer: _PeerIn, renew: Renew) -> RenewReply:
        now = time.monotonic()
        statuses, remaining = [], []
        for rid in renew.request_ids:
            lease = self._leases.get(rid)
            if lease is not None and lease.peer == peer.name and now >= lease.expires_at:
                self._expire(lease)
                lease = None
            if lease is not None and lease.peer == peer.name:
                if lease.abort_pending:
                    statuses.append("aborted")
                    remaining.append(0.0)
                    continue
                lease.pinned = True
                lease.expires_at = max(lease.expires_at, now + self.lease_seconds)
                statuses.append("ok")
                remaining.append(lease.expires_at - now)
                continue
            outcome, holder = self._tombstones.get(rid, ("", ""))
            status = {"read_done": "done", "aborted": "aborted", "lease_expired": "expired",
                      "peer_failed": "expired"}.get(outcome, "unknown")
            statuses.append(status if holder == peer.name else "unknown")
            remaining.append(0.0)
        return RenewReply(renew.seq, list(renew.request_ids), statuses, remaining)

    def _serve_peer(self, sock: zmq.Socket, name: str) -> None:
        peer = self._peers_out.get(name)
        for msg in self._recv_frames(sock):
            try:
                if len(msg) != 1:
                    raise WireError(f"expected one frame, got {len(msg)}")
                frame = decode(msg[0], self.max_frame_bytes)
            except WireError as e:
                self._stats.rejected_frames += 1
                log.warning("side channel: rejected a frame from %s: %s", name, e)
                continue
            if peer is None or peer.sock is not sock:
                continue
            peer.awaiting_since = None  # any valid frame proves the sender is alive
            if isinstance(frame, RenewReply):
                self._on_renew_reply(peer, frame)
            elif isinstance(frame, Abort):
                read = self._reads.get(frame.request_id)
                if read is not None and read.peer == name and not read.status.state.terminal:
                    read.aborted = True
                    # Echo so a sender waiting on a pinned lease frees it once we let go.
                    self._fail(read, f"aborted by the sender ({frame.reason})", tell_sender=True)
            elif isinstance(frame, ErrorReply):
                log.warning("side channel: %s says %s", name, frame.message)

    def _on_renew_reply(self, peer: _PeerOut, reply: RenewReply) -> None:
        sent = peer.sent_at.pop(reply.seq, None)
        for rid, status, remaining in zip(reply.request_ids, reply.statuses, reply.remaining_s,
                                          strict=True):
            read = self._reads.get(rid)
            if read is None or read.peer != peer.name or read.status.state.terminal:
                continue
            if status == "ok":
                read.acked = True
                if sent is not None:  # measured from our send: never later than the sender's
                    read.lease_until = sent + remaining
            elif status == "done":
                read.acked = True
                read.lease_until = math.inf
            else:
                self._fail(read, f"the sender reports the lease {status}")

    # ------------------------------------------------------------------ helpers

    def _compat_diff(self, version: int, chash: str, fields: dict[str, str]) -> list[str]:
        diff = differing_fields(self._compat, fields)
        if version != PROTOCOL_VERSION:
            diff.insert(0, "protocol_version")
        if not diff and chash != self._compat_hash:
            diff = ["compat_hash"]
        return diff

    def _check_compat(self, peer: str, version: int, chash: str, fields: dict[str, str]) -> None:
        diff = self._compat_diff(version, chash, fields)
        if diff:
            mine = {**self._compat, "protocol_version": str(PROTOCOL_VERSION),
                    "compat_hash": self._compat_hash}
            theirs = {**fields, "protocol_version": str(version), "compat_hash": chash}
            raise HandshakeError(peer, describe_differences(diff, mine, theirs), tuple(diff))

    @staticmethod
    def _check_block_ids(request_id: str, ids: Any, num_blocks: int) -> tuple[int, ...]:
        if not isinstance(request_id, str) or not request_id or len(request_id) > 256:
            raise TransferError(str(request_id)[:256], "request_id must be a non-empty string")
        if not isinstance(ids, list | tuple) or not ids:
            raise TransferError(request_id, "block ids must be a non-empty list")
        if any(isinstance(b, bool) or not isinstance(b, int | np.integer) for b in ids):
            raise TransferError(request_id, "block ids must be ints")
        out = tuple(int(b) for b in ids)
        if min(out) < 0 or max(out) >= num_blocks:
            raise TransferError(request_id, f"block ids must be in [0, {num_blocks})")
        if len(set(out)) != len(out):
            raise TransferError(request_id, "block ids must not repeat")
        return out

    def _socket(self, kind: int) -> zmq.Socket:
        s = self._ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        # Past this ZMQ drops the connection before buffering the frame; decode() answers
        # frames between max_frame_bytes and this with an ErrorReply.
        s.setsockopt(zmq.MAXMSGSIZE, 4 * self.max_frame_bytes)
        return s

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake-up is pending anyway) or closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"KV transfer agent {self.name!r} is closed")


class _Serialized:
    """A NIXL agent whose every method call holds one lock: the worker thread and the
    side-channel thread (progress, notifications) both call it."""

    def __init__(self, agent: Any, lock: threading.RLock):
        self._agent = agent
        self._lock = lock

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._agent, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return attr(*args, **kwargs)

        return call


def _advertised(bound: str, advertise_host: str | None) -> str:
    """The endpoint peers should dial: a wildcard bind is advertised under a routable name."""
    host, _, port = bound.removeprefix("tcp://").rpartition(":")
    if advertise_host:
        host = advertise_host
    elif host in ("0.0.0.0", "*", "[::]"):
        host = socket.gethostbyname(socket.gethostname())
    return f"tcp://{host}:{port}"


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass


def _quiet(fn) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - cleanup must go on past one failed step
        log.debug("cleanup step failed: %s", e)
