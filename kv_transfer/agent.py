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

Peers and incarnations: by default an agent exchanges KV with any compatible peer. Given the
registry's map (`set_allowed_peers({name: instance_id})`, from any thread, again whenever the
registry changes) it refuses every other (name, instance) on both ends: the sender answers
such a Hello with a refusal and registers no reader; the receiver's `connect` refuses such
metadata (StalePeerError / UnknownPeerError) without dialling, so the block ids of a KVReady
from an old incarnation are never read. A restarted worker keeps its name and gets a new
instance id: the leases its old instance pinned are freed at once (Released peer_restarted),
since Ray restarts an actor only after its process died; see sender.py and messages.py.

Failure paths: the lease runs out (sender: Released lease_expired / peer_failed when the reader
had pinned it), abort on either side (Abort on the side channel; Released/ReadFailed aborted),
a dead or hung sender (NIXL error, or no RenewReply for peer_timeout_s: ReadFailed), a READ
longer than read_timeout_s (ReadFailed). Events come out of `poll()` only once no READ can
touch the blocks any more, so the worker may free or reuse them at once.

The agent is a facade over four parts, each with the detailed lifecycle of its role:

    sender.LeaseTable         leases: hold, pin/renew, expiry, abort, Released
    receiver.Receiver         handshake client, chunked READs, renewals, peer liveness,
                              failure deadlines, ReadDone/ReadFailed
    side_channel.SideChannel  ZMQ ROUTER/DEALERs and the daemon thread that owns them:
                              handshake answer, frame validation, heartbeat, NIXL progress
    nixl.NixlEndpoint         registered memory, prepped descriptor lists, READs, notifs

Fault injection (`faults=FaultPlan(...)`, faults.py) is decided once, here, at construction:
an empty plan leaves every path as it is.

Threads and locks: the worker thread calls the public methods, which this facade serializes
under its API lock; the side-channel thread answers handshakes and renewals while the worker
is busy in a forward pass, and takes NIXL notifications (which progresses UCX, NIXL's own
spinning progress thread being off); it never touches the engine. Each part owns one lock for
its own state. Lock order: API -> receiver -> sender -> side channel -> nixl; never the
reverse. Today no two part locks are ever held together: a part releases its lock before
calling another part, so the side-channel thread (which never takes the API lock) cannot
deadlock with the worker thread, and it skips a notification round rather than wait behind
a READ the worker is posting under the NIXL lock.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Self

from engine.kv_cache import KVCache
from kv_transfer.errors import HandshakeError
from kv_transfer.faults import FaultPlan
from kv_transfer.messages import (
    MAX_SIDE_FRAME_BYTES,
    PROTOCOL_VERSION,
    AgentMetadata,
    Compat,
    Hello,
    HelloReply,
    PeerPolicy,
    TransferEvent,
    TransferState,
    TransferStats,
)
from kv_transfer.nixl import NixlEndpoint, default_max_read_bytes
from kv_transfer.read_state import ReceiverConfig
from kv_transfer.receiver import Receiver
from kv_transfer.sender import LeaseTable
from kv_transfer.side_channel import SideChannel
from kv_transfer.tp_read import RankReads


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
        max_read_bytes: int | None = None,
        max_frame_bytes: int = MAX_SIDE_FRAME_BYTES,
        warmup: bool = True,
        advertise_host: str | None = None,
        progress_thread: bool = False,
        faults: FaultPlan | dict | None = None,
        tp_group=None,
    ):
        self.name = name
        self.faults = FaultPlan.coerce(faults)  # validated before anything is started
        self.kv_cache = kv_cache
        self.spec = kv_cache.spec
        self.lease_seconds = float(lease_seconds)
        self.read_timeout_s = float(read_timeout_s)
        self.peer_timeout_s = float(peer_timeout_s)
        # Renew well inside the lease so one lost beat never lets it lapse under a live reader.
        self.heartbeat_s = float(
            min(0.5, lease_seconds / 4) if heartbeat_s is None else heartbeat_s
        )
        self.handshake_timeout_s = float(handshake_timeout_s)
        if max_read_bytes is None:
            max_read_bytes = default_max_read_bytes(kv_cache.device)
        self.max_read_bytes = int(max_read_bytes)
        self.max_frame_bytes = int(max_frame_bytes)
        self._check_settings()
        self.instance_id = uuid.uuid4().hex
        self._compat = Compat(self.spec.compat_fields(), self.spec.compat_hash())
        # A tensor-parallel engine's other ranks (engine.tp): their KV is registered with
        # agents of their own, described in our HelloReply (kv_transfer/tp_rank.py).
        self._ranks, self._tp_group = [], None
        if tp_group is not None and getattr(tp_group, "size", 1) > 1:
            from kv_transfer.tp_rank import rank_regions

            self._ranks = rank_regions(tp_group, name, progress_thread)
            self._tp_group = tp_group  # as a receiver, its ranks READ too (tp_read.py)
        self._api_lock = threading.RLock()
        self._closed = False
        self._start_parts(bind_host, advertise_host, warmup, progress_thread)

    def _check_settings(self) -> None:
        if not isinstance(self.name, str) or not self.name or len(self.name) > 200:
            raise ValueError("name must be a non-empty string of at most 200 chars")
        for label in ("lease_seconds", "read_timeout_s", "peer_timeout_s", "handshake_timeout_s"):
            if not getattr(self, label) > 0:
                raise ValueError(f"{label} must be > 0, got {getattr(self, label)}")
        hb = self.heartbeat_s
        if not 0 < hb < self.lease_seconds / 2 or hb >= self.peer_timeout_s:
            raise ValueError("heartbeat_s must be > 0, < lease_seconds/2 and < peer_timeout_s")
        if self.max_read_bytes < 1 or self.max_frame_bytes < 1024:
            raise ValueError("max_read_bytes must be >= 1 and max_frame_bytes >= 1024")

    def _start_parts(
        self, bind_host: str, advertise_host: str | None, warmup: bool, progress_thread: bool
    ) -> None:
        self.nixl = NixlEndpoint(self.name, self.kv_cache, progress_thread)  # public for tests
        self.region = self.nixl.region
        self._channel = SideChannel(
            self.name, bind_host, advertise_host, self.max_frame_bytes, self.heartbeat_s
        )
        self.endpoint = self._channel.endpoint
        self._sender = LeaseTable(
            self.lease_seconds, self.region.num_blocks, self.region.bytes_per_block, self.name
        )
        config = ReceiverConfig(
            read_timeout_s=self.read_timeout_s,
            peer_timeout_s=self.peer_timeout_s,
            handshake_timeout_s=self.handshake_timeout_s,
            max_read_bytes=self.max_read_bytes,
            max_frame_bytes=self.max_frame_bytes,
            warmup=warmup,
        )
        hello = Hello(
            PROTOCOL_VERSION,
            self.name,
            self.instance_id,
            self._compat.hash,
            dict(self._compat.fields),
            self.endpoint,
        )
        ranks = None
        if self._tp_group is not None:
            ranks = RankReads(
                self._tp_group, self.name, self.handshake_timeout_s, warmup, self.faults
            )
        self._receiver = Receiver(
            hello, self._compat, self.nixl, self._channel, config, self.faults, ranks
        )
        self._channel.start(
            self._compat,
            self._welcome(),
            self._sender,
            self._receiver,
            self.nixl.take_notifs,
            self.faults,
        )

    def _welcome(self) -> HelloReply:
        """What a compatible reader learns at handshake: our NIXL metadata and region."""
        r = self.region
        return HelloReply(
            ok=True,
            name=self.name,
            instance_id=self.instance_id,
            nixl_metadata=self.nixl.metadata,
            mem_type=r.mem_type,
            device_id=r.device_id,
            num_blocks=r.num_blocks,
            data_base=r.data_base,
            block_bytes=r.block_bytes,
            scales_base=r.scales_base,
            scale_block_bytes=r.scale_block_bytes,
            tp_size=self.spec.tp_size,
            ranks=list(self._ranks),
        )

    # ------------------------------------------------------------------ both sides

    def metadata(self) -> dict:
        """What peers need to reach this agent (msgpack-able; for the registry and KVReady)."""
        return self.agent_metadata().to_dict()

    def agent_metadata(self) -> AgentMetadata:
        return AgentMetadata(
            name=self.name,
            instance_id=self.instance_id,
            endpoint=self.endpoint,
            protocol_version=PROTOCOL_VERSION,
            compat_hash=self._compat.hash,
            compat_fields=dict(self._compat.fields),
            num_blocks=self.region.num_blocks,
            mem_type=self.region.mem_type,
        )

    def set_allowed_peers(self, peers: dict[str, str] | None) -> None:
        """The agents this one may exchange KV with, name -> agent instance_id (the registry's
        current incarnations); None allows any (the default). Thread-safe; call it again on
        every registry change. Established peers and readers the map no longer allows are
        dropped: a sender's reads fail (ReadFailed); a replaced reader's pinned leases are
        released at once (Released peer_restarted), a removed one's at their normal expiry."""
        policy = PeerPolicy(peers)  # validated and copied before anything changes
        with self._api_lock:
            self._check_open()
            self._receiver.set_policy(policy)
            self._sender.set_policy(policy)
        self._channel.wake()

    def poll(self) -> list[TransferEvent]:
        """Advance transfers and return what finished; call it every worker-loop iteration."""
        with self._api_lock:
            self._check_open()
            now = time.monotonic()
            self._sender.on_notifs(self.nixl.take_notifs(wait=True))
            self._sender.expire(now)
            self._receiver.advance()
            return [*self._sender.take_events(), *self._receiver.take_events()]

    def abort(self, request_id: str, peer_name: str | None = None) -> bool:
        """Give up `request_id` on this side and tell the peer; returns whether it was known.

        Sender: the lease is released at once (Released "aborted" at the next poll), or, if the
        reader already pinned it, once the reader lets go. Receiver: the READ is cancelled and
        ReadFailed "aborted" follows. `peer_name` lets a receiver that never started the READ
        still tell the sender to free its blocks now rather than at lease expiry.
        """
        with self._api_lock:
            known = self._sender.abort(request_id)
            known = self._receiver.abort(request_id, None if known else peer_name) or known
        self._channel.wake()
        return known

    def stats(self) -> TransferStats:
        return self._sender.stats() + self._receiver.stats() + self._channel.stats()

    def num_held(self) -> int:
        """Sender side: requests whose blocks are still held."""
        return self._sender.num_held()

    def transfer_state(self, request_id: str) -> TransferState | None:
        """Receiver side: the state of a request still tracked here (None once reported)."""
        return self._receiver.transfer_state(request_id)

    def close(self) -> None:
        with self._api_lock:
            if self._closed:
                return
            self._closed = True
            self._channel.stop()
            self._receiver.close()
            self.nixl.close()
            self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ sender

    def hold(self, request_id: str, block_ids: list[int], peer_name: str) -> float:
        """Hold `block_ids` for `peer_name` to read; returns the lease deadline (unix seconds)."""
        with self._api_lock:
            self._check_open()
            return self._sender.hold(request_id, block_ids, peer_name)

    # ------------------------------------------------------------------ receiver

    def connect(self, peer_metadata: AgentMetadata | dict) -> None:
        """Handshake with a sender once (idempotent per peer instance); raise HandshakeError
        naming the differing fields when the layouts do not match, and its subclass
        PeerNotAllowedError (UnknownPeerError / StalePeerError here, without dialling; the
        base class when the sender's map refuses us) for a peer outside the allowed map.
        Nothing is transferred to or from a peer that is refused."""
        try:
            md = AgentMetadata.coerce(peer_metadata)
        except (ValueError, TypeError) as e:
            name = peer_metadata.get("name", "?") if isinstance(peer_metadata, dict) else "?"
            raise HandshakeError(str(name), f"malformed peer metadata: {e}") from e
        with self._api_lock:
            self._check_open()
            self._receiver.connect(md)

    def start_read(
        self,
        request_id: str,
        peer_name: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        lease_deadline: float,
        *,
        sender_instance: str | None = None,
    ) -> None:
        """Start pulling `remote_block_ids` of `peer_name` into `local_block_ids` (allocated by
        the caller). The outcome arrives from poll() as ReadDone or ReadFailed; a lease already
        known to have expired never starts a READ (ReadFailed at the next poll).
        `sender_instance` (the KVReady's `sender.instance_id`) makes sure the blocks are read
        from the incarnation that holds them, not from a newer one of the same name.

        Raises TransferError for a call that cannot be honoured at all (unknown peer, another
        instance than `sender_instance`, bad ids, a request already in progress)."""
        with self._api_lock:
            self._check_open()
            self._receiver.start_read(
                request_id,
                peer_name,
                remote_block_ids,
                local_block_ids,
                lease_deadline,
                sender_instance,
            )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"KV transfer agent {self.name!r} is closed")
