"""The decode worker's KV connector: continuous batching over requests from two sources.

Local prefill: a `GenerateRequest` runs here from prompt to last token (short prompts; the
router's conditional disaggregation). The loop handles it; this connector counts it, and when
the request names a peer holding more of its prompt (`prefix_from`) first READs those blocks
(kv_transfer/prefix_pull.py `PrefixPuller`, admitted by `_admit_local`). Any worker's
prefill may also READ blocks of this worker's prefix cache (`PrefixLender`).

Remote prefill (the default path), from this side. The engine's scheduler owns admission (one
policy, one block pool, engine/scheduler.py); this connector decides which blocks to read and
what a failure means, and its agent moves the bytes. One record per request
(`RemoteTransfer`, in `DecodeConnector.requests`), by stage:

    KVReady -> QUEUED: `LLMEngine.add_remote_request` (and a `handoff` TokenMessage tells the
      router this worker owns the request now): queued with local requests, FIFO, until the
      scheduler has a sequence slot and the prompt's blocks (natural backpressure: nothing is
      admitted that cannot be held)
    -> `on_remote_admitted(rid, blocks, reused)` -> READING: handshake with the sender once per
       pair, a NIXL READ into the blocks just allocated (engine state REMOTE_KV); the first
       `reused` blocks are this worker's prefix-cache blocks of the same leading tokens, so
       only the rest is read (the partial last block always is)
    -> `ReadDone` -> `commit_remote`: the sequence joins the running batch at the next step
       with the prefill worker's first token in place, streams tokens from index 1, and the
       record ends (from here it is an ordinary sequence of the engine).
  `ReadFailed` (peer died, lease expired, timeout), a lease that expired while the request
  queued, or a transfer that cannot start: by policy the prompt is prefilled here
  (`recompute_remote`, "recompute", the default) or the request fails ("error"); either way
  the record ends. A request is never answered from KV that did not arrive whole. An
  incompatible peer (`HandshakeError`) always fails: recomputing would hide a misconfiguration.

Aborts (the router aborts both workers at once, so an abort can come at any point):
  before KVReady  -> ABORTED_EARLY record (bounded, oldest forgotten first); the late KVReady
                     ends it, is dropped, and the sender is told to release its blocks at once
  QUEUED          -> the record ends, the engine drops the request (it holds no blocks) and
                     the sender is told to release
  READING         -> CANCELLING: the READ is cancelled; the blocks are freed on the
                     `ReadFailed` (or a late `ReadDone`) that follows, never before (no READ
                     can land in a reused block), and the record ends there
  after ReadDone  -> an ordinary abort: the engine frees the blocks

The split (vLLM v1's): this object is the scheduler-side half (records, which blocks to read,
the failure policy, when blocks go back); the agent behind `KVReader` is the worker-side half
(handshakes, READs, renewals, on its own thread). `_read_plan` reads only the blocks the local
prefix cache lacks. Tensor parallelism puts one reader per rank behind
`KVReader`, a request done when every rank's reads are.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from engine.protocol import GenerateRequest, TokenMessage
from engine.roles import DECODE
from kv_transfer.errors import HandshakeError, PeerNotAllowedError, TransferError
from kv_transfer.messages import (
    AgentMetadata,
    KVReady,
    PrefixOffer,
    PrefixPull,
    ReadDone,
    ReadFailed,
    TransferEvent,
    TransferStats,
)
from kv_transfer.prefix_pull import PrefixLender, PrefixPuller

if TYPE_CHECKING:
    from engine.engine_server import ConnectorHost

log = logging.getLogger(__name__)
FAILURE_POLICIES = ("recompute", "error")
MAX_EARLY_ABORTS = 10_000


class KVReader(Protocol):
    """The receiver half of a `kv_transfer.agent.KVTransferAgent` (what this connector uses)."""

    def connect(self, peer_metadata: AgentMetadata) -> None: ...

    def start_read(
        self,
        request_id: str,
        peer_name: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        lease_deadline: float,
        sender_instance: str | None = None,
    ) -> None: ...

    def abort(self, request_id: str, peer_name: str | None = None) -> bool: ...

    def poll(self) -> list[TransferEvent]: ...

    def stats(self) -> TransferStats: ...

    def close(self) -> None: ...


class DecodeStage(enum.Enum):
    ABORTED_EARLY = "aborted_early"  # an abort came first; the KVReady may still come
    QUEUED = "queued"  # in the engine's queue: no blocks, no READ
    READING = "reading"  # blocks allocated, READ in flight
    CANCELLING = "cancelling"  # aborted during its READ: blocks freed when the READ is over


@dataclass(slots=True)
class RemoteTransfer:
    """Everything this worker keeps for one request whose KV comes from a peer."""

    request_id: str
    stage: DecodeStage
    ready: KVReady | None = None  # None only for ABORTED_EARLY
    block_ids: list[int] = field(default_factory=list)  # READING: the request's local blocks
    num_reused_blocks: int = 0  # leading blocks of block_ids this worker already held


class DecodeConnector:
    """See the module docstring. Compose it with `engine.engine_server.EngineServer`."""

    role = DECODE

    def __init__(self, agent: KVReader, on_transfer_failure: str = "recompute"):
        if on_transfer_failure not in FAILURE_POLICIES:
            raise ValueError(f"on_transfer_failure must be one of {FAILURE_POLICIES}")
        self.agent = agent
        self.policy = on_transfer_failure
        # In arrival order: the oldest ABORTED_EARLY records are forgotten first.
        self.requests: dict[str, RemoteTransfer] = {}
        self._counts = dict.fromkeys(DecodeStage, 0)  # records per stage: _begin/_move/_end
        self.num_remote = 0
        self.num_local = 0
        self.num_recomputed = 0
        self.num_reused_blocks = 0  # blocks not read: this worker's prefix cache held them
        self.num_read_blocks = 0  # blocks READ from prefill peers
        self._host: ConnectorHost | None = None
        self.lender = PrefixLender(agent)  # prefill workers may READ our cached prefixes
        # A local prefill may READ its prompt's leading blocks from a peer first.
        self.puller = PrefixPuller(agent, self._admit_local)
        self.pins: dict[str, list[int]] = {}  # local request -> prefix blocks pinned for it

    def attach(self, host: ConnectorHost) -> None:
        self._host = host

    # -- records -----------------------------------------------------------------------------
    def _begin(self, rec: RemoteTransfer) -> None:
        self.requests[rec.request_id] = rec
        self._counts[rec.stage] += 1

    def _move(self, rec: RemoteTransfer, stage: DecodeStage) -> None:
        self._counts[rec.stage] -= 1
        self._counts[stage] += 1
        rec.stage = stage

    def _end(self, request_id: str) -> RemoteTransfer | None:
        rec = self.requests.pop(request_id, None)
        if rec is not None:
            self._counts[rec.stage] -= 1
        return rec

    def num_in(self, *stages: DecodeStage) -> int:
        """How many records are in any of `stages` (safe from another thread)."""
        return sum(self._counts[s] for s in stages)

    # -- frames ------------------------------------------------------------------------------
    def handle(self, msg: Any) -> bool:
        if isinstance(msg, KVReady):
            self._queue_remote(msg)
            return True
        if isinstance(msg, PrefixPull):  # a peer reads blocks of our prefix cache
            self.lender.handle(self._host, msg)
            return True
        if isinstance(msg, PrefixOffer):
            self.puller.on_offer(self._host, msg)
            return True
        if isinstance(msg, GenerateRequest):
            self.num_local += 1  # a local prefill: the loop runs it, the split is counted here
            # With a prefix source, it enters the engine once the pull is over (_admit_local).
            return self.puller.start(self._host, msg)
        return False

    def _admit_local(self, req: GenerateRequest, pins: list[int]) -> None:
        host = self._host
        host.add_generate(req)
        if pins and req.request_id in host.engine.seqs and req.request_id not in self.pins:
            self.pins[req.request_id] = pins  # freed when it finishes or is aborted
        elif pins:
            host.engine.block_manager.free(pins)

    def _unpin(self, request_id: str) -> None:
        pins = self.pins.pop(request_id, None)
        if pins:
            self._host.engine.block_manager.free(pins)

    def _queue_remote(self, msg: KVReady) -> None:
        rid, host = msg.request_id, self._host
        rec = self.requests.get(rid)
        if rec is not None and rec.stage is DecodeStage.ABORTED_EARLY:
            self._end(rid)  # aborted before its KV was offered: drop it now
            self._release_on_sender(msg)
            host.count_abort()
            return
        try:
            choices = [tuple(c) for c in msg.choices] if msg.choices else None
            host.engine.add_remote_request(
                rid, msg.prompt_token_ids, msg.first_token, msg.sampling, choices
            )
        except ValueError as e:
            self._release_on_sender(msg)
            host.send_error(msg.reply_to, rid, str(e))
            return
        self._begin(RemoteTransfer(rid, DecodeStage.QUEUED, msg))
        host.stream(rid, msg.reply_to, len(msg.choices) if msg.choices else 1)
        # Tell the router this worker owns the request now (see router/routing.py).
        host.send(
            msg.reply_to,
            TokenMessage(
                request_id=rid, index=0, token_ids=[], worker_id=host.worker_id, handoff=True
            ),
        )

    # -- the engine's calls ------------------------------------------------------------------
    def on_remote_admitted(
        self, request_id: str, block_ids: list[int], num_reused_blocks: int
    ) -> None:
        rec = self.requests[request_id]
        msg = rec.ready
        if time.time() >= msg.lease_deadline:
            self._fallback(request_id, "its lease expired before this worker had room")
            return
        try:
            self.agent.connect(msg.sender)
        except PeerNotAllowedError as e:  # a stale incarnation or no registered peer
            self._fallback(request_id, str(e))
            return
        except HandshakeError as e:  # incompatible peer: recomputing would hide a misconfig
            self._fail(request_id, str(e))
            return
        except TransferError as e:
            self._fallback(request_id, str(e))
            return
        rec.block_ids, rec.num_reused_blocks = list(block_ids), num_reused_blocks
        remote, local = self._read_plan(rec)
        try:
            self.agent.start_read(
                request_id,
                msg.sender.name,
                remote,
                local,
                msg.lease_deadline,
                sender_instance=msg.sender.instance_id,
            )
        except TransferError as e:
            self._release_on_sender(msg)  # no READ will come: the sender need not wait
            self._fallback(request_id, str(e))
            return
        self._move(rec, DecodeStage.READING)

    def _read_plan(self, rec: RemoteTransfer) -> tuple[list[int], list[int]]:
        """(the sender's block ids, this worker's block ids) to READ: block i of the prompt on
        both sides, past the leading blocks the local prefix cache already holds. The scheduler
        never reuses the block of the prompt's last token, so at least one block is read."""
        k = rec.num_reused_blocks
        return list(rec.ready.block_ids[k:]), rec.block_ids[k:]

    # -- the loop's calls --------------------------------------------------------------------
    def before_step(self) -> None:
        for ev in self.agent.poll():
            if self.lender.on_event(self._host, ev) or self.puller.on_event(self._host, ev):
                continue
            if isinstance(ev, ReadDone):
                self._landed(ev.request_id)
            elif isinstance(ev, ReadFailed):
                self._read_failed(ev.request_id, ev.reason)
        self.puller.expire(self._host)

    def after_step(self) -> None:
        pass

    def _landed(self, rid: str) -> None:
        rec = self._end(rid)
        if rec is None or rec.stage is not DecodeStage.READING:
            self._host.engine.abort(rid)  # cancelled: the READ is over, the blocks go back
            return
        self.num_remote += 1
        self.num_reused_blocks += rec.num_reused_blocks
        self.num_read_blocks += len(rec.block_ids) - rec.num_reused_blocks
        self._host.publish(self._host.engine.commit_remote(rid))

    def _read_failed(self, rid: str, reason: str) -> None:
        rec = self.requests.get(rid)
        if rec is None or rec.stage is not DecodeStage.READING:
            self._end(rid)
            self._host.engine.abort(rid)  # the READ is over: the blocks can be reused
            self._host.forget(rid)
            return
        self._fallback(rid, f"KV transfer from {rec.ready.prefill_worker_id} failed: {reason}")

    def _fallback(self, rid: str, why: str) -> None:
        """No READ is in flight for `rid` (none started, or it is over): recompute or fail."""
        log.warning("%s: %s: %s", self._host.worker_id, rid, why)
        if self.policy == "recompute":
            self._end(rid)
            self._host.engine.recompute_remote(rid)
            self.num_recomputed += 1
            return
        self._fail(rid, why)

    def _fail(self, rid: str, why: str) -> None:
        rec = self._end(rid)
        self._host.engine.abort(rid)
        self._host.forget(rid)
        self._host.send_error(rec.ready.reply_to, rid, why)

    def _release_on_sender(self, msg: KVReady) -> None:
        """Tell the prefill worker now that its blocks will not be read (else the lease
        would hold them until it expires)."""
        try:
            self.agent.connect(msg.sender)
        except (HandshakeError, TransferError) as e:
            log.warning(
                "%s: cannot reach %s to release %s: %s",
                self._host.worker_id,
                msg.sender.name,
                msg.request_id,
                e,
            )
        self.agent.abort(msg.request_id, peer_name=msg.sender.name)

    # -- aborts ------------------------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        self._unpin(request_id)
        if self.puller.abort(self._host, request_id):
            return True
        rec = self.requests.get(request_id)
        if rec is None or rec.stage is DecodeStage.ABORTED_EARLY:
            return False
        if rec.stage is DecodeStage.QUEUED:  # no blocks, no READ: the engine drops it
            self._end(request_id)
            self._release_on_sender(rec.ready)
            return False
        self._move(rec, DecodeStage.CANCELLING)
        self.agent.abort(request_id)  # blocks are freed when the READ is over
        return True

    def abort_unknown(self, request_id: str) -> None:
        """Neither this connector nor the engine knows `request_id`: its KVReady may still be
        on its way from the prefill worker (or it finished already: then nothing comes)."""
        if request_id in self.requests:
            return
        self._begin(RemoteTransfer(request_id, DecodeStage.ABORTED_EARLY))
        if self._counts[DecodeStage.ABORTED_EARLY] > MAX_EARLY_ABORTS:
            oldest = next(
                r for r, x in self.requests.items() if x.stage is DecodeStage.ABORTED_EARLY
            )
            self._end(oldest)

    def request_finished(self, request_id: str) -> None:
        # A remote request finishes only after its record ended (committed or recomputed);
        # a local one may hold prefix blocks pinned by its pull.
        self._unpin(request_id)

    def has_pending_work(self) -> bool:
        return self.num_in(DecodeStage.READING, DecodeStage.CANCELLING) > 0 or self.puller.busy()

    def holds_nothing(self) -> bool:
        busy = self.num_in(DecodeStage.QUEUED, DecodeStage.READING, DecodeStage.CANCELLING)
        return busy == 0 and not self.lender.lent and not self.puller.busy()

    # -- load report -------------------------------------------------------------------------
    def extra_load(self) -> dict:
        st = self.agent.stats()
        return {
            "incoming": self.num_in(DecodeStage.QUEUED),
            "reading": self.num_in(DecodeStage.READING, DecodeStage.CANCELLING),
            "remote_prefills": self.num_remote,
            "local_prefills": self.num_local,
            "recomputed": self.num_recomputed,
            "reused_blocks": self.num_reused_blocks,
            "read_blocks": self.num_read_blocks,
            "transfer_bytes": st.bytes_read,
            "transfer_seconds": st.seconds,
            "transfer_failures": st.failures,
            "expired_leases": st.expired_leases,
            "transfer_gbps": st.gbps,
            "refused_peers": st.refused_peers,
            "rejected_frames": st.rejected_frames,
            "prefix_lent_blocks": self.lender.num_lent_blocks,
            "prefix_pulls": self.puller.num_pulls,
            "prefix_pulled_blocks": self.puller.num_pulled_blocks,
            "prefix_pull_failures": self.puller.num_failed,
        }

    def close(self) -> None:
        self.agent.close()
