"""The decode worker's loop: continuous batching over requests from two sources.

Local prefill: a `GenerateRequest` runs here from prompt to last token (short prompts; the
router's conditional disaggregation).

Remote prefill (the default path), from this side. The engine's scheduler owns admission (one
policy, one block pool, engine/scheduler.py); this server is the engine's KV connector
(engine/kv_connector.py) and moves the bytes:
  KVReady arrives -> `LLMEngine.add_remote_request` (and a `handoff` TokenMessage tells the
  router this worker owns the request now): queued with local requests, FIFO, until the
  scheduler has a sequence slot and the prompt's blocks (natural backpressure: nothing is
  admitted that cannot be held)
  -> `on_remote_admitted(rid, blocks)`: handshake with the sender once per pair, a NIXL READ
     into the blocks just allocated (state REMOTE_KV)
  -> `ReadDone` -> `commit_remote`: the sequence joins the running batch at the next step with
     the prefill worker's first token in place, and streams tokens from index 1.
  `ReadFailed` (peer died, lease expired, timeout), a lease that expired while the request
  queued, or a transfer that cannot start: by policy the prompt is prefilled here
  (`recompute_remote`, "recompute", the default) or the request fails ("error"): a request is
  never answered from KV that did not arrive whole.

Aborts (the router aborts both workers at once, so an abort can come at any point):
  before KVReady  -> remembered (`early_aborts`); the late KVReady is dropped and the sender
                     told to release its blocks at once
  KVReady queued  -> dropped from the engine (it holds no blocks) and the sender told to release
  during the READ -> the READ is cancelled; the blocks are freed on the `ReadFailed` that
                     follows, never before (no READ can land in a reused block)
  after ReadDone  -> an ordinary abort: the engine frees the blocks
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from engine.engine_server import EngineServer
from engine.kv_connector import Handoff
from engine.llm_engine import LLMEngine
from engine.protocol import TokenMessage
from engine.roles import DECODE
from kv_transfer.agent import KVTransferAgent
from kv_transfer.errors import HandshakeError, PeerNotAllowedError, TransferError
from kv_transfer.events import ReadDone, ReadFailed
from kv_transfer.messages import KVReady

log = logging.getLogger(__name__)
FAILURE_POLICIES = ("recompute", "error")
MAX_EARLY_ABORTS = 10_000


class DecodeServer(EngineServer):
    def __init__(
        self,
        worker_id: str,
        engine: LLMEngine,
        agent: KVTransferAgent,
        bind_host: str = "127.0.0.1",
        on_transfer_failure: str = "recompute",
        max_frame_bytes: int = 16 << 20,
    ):
        if on_transfer_failure not in FAILURE_POLICIES:
            raise ValueError(f"on_transfer_failure must be one of {FAILURE_POLICIES}")
        self.agent = agent
        super().__init__(worker_id, DECODE, engine, bind_host, max_frame_bytes)
        engine.set_kv_connector(self)
        self.policy = on_transfer_failure
        self.remote: dict[str, KVReady] = {}  # hand-offs queued in the engine or being read
        self.reading: set[str] = set()
        self.aborted: set[str] = set()  # aborted during their READ: freed on ReadFailed
        # Aborts that arrived before their KVReady (the prefill worker may still be working).
        # Bounded, oldest forgotten first.
        self.early_aborts: OrderedDict[str, None] = OrderedDict()
        self.num_remote = 0
        self.num_local = 0
        self.num_recomputed = 0

    # -- input -------------------------------------------------------------------------------
    def handle(self, msg) -> None:
        if isinstance(msg, KVReady):
            self._queue_remote(msg)
        else:
            super().handle(msg)

    def _queue_remote(self, msg: KVReady) -> None:
        rid = msg.request_id
        if rid in self.early_aborts:  # aborted before its KV was offered: drop it now
            del self.early_aborts[rid]
            self._release_on_sender(msg)
            self.num_aborts += 1
            return
        try:
            choices = [tuple(c) for c in msg.choices] if msg.choices else None
            self.engine.add_remote_request(
                rid, msg.prompt_token_ids, msg.first_token, msg.sampling, choices
            )
        except ValueError as e:
            self._release_on_sender(msg)
            self.send_error(msg.reply_to, rid, str(e))
            return
        self.remote[rid] = msg
        self.reply_to[rid] = msg.reply_to
        self.open_choices[rid] = len(msg.choices) if msg.choices else 1
        # Tell the router this worker owns the request now (see router/pool.py).
        self.replies.send(
            msg.reply_to, TokenMessage(rid, 0, [], worker_id=self.worker_id, handoff=True)
        )

    def add_generate(self, msg) -> None:
        self.num_local += 1
        super().add_generate(msg)

    # -- the engine's KV connector (decode half) ----------------------------------------------
    def on_prefilled(self, handoff: Handoff) -> bool:
        return False  # a decode engine never hands KV on

    def on_remote_admitted(self, request_id: str, block_ids: list[int]) -> None:
        msg = self.remote[request_id]
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
        try:
            self.agent.start_read(
                request_id,
                msg.sender.name,
                msg.block_ids,
                block_ids,
                msg.lease_deadline,
                sender_instance=msg.sender.instance_id,
            )
        except TransferError as e:
            self._release_on_sender(msg)  # no READ will come: the sender need not wait
            self._fallback(request_id, str(e))
            return
        self.reading.add(request_id)

    # -- transfer events ------------------------------------------------------------------
    def has_pending_work(self) -> bool:
        return bool(self.reading)

    def holds_nothing(self) -> bool:
        return not self.remote and not self.reading and not self.aborted

    def before_step(self) -> None:
        for ev in self.agent.poll():
            if isinstance(ev, ReadDone):
                self._landed(ev.request_id)
            elif isinstance(ev, ReadFailed):
                self._read_failed(ev.request_id, ev.reason)

    def _landed(self, rid: str) -> None:
        self.reading.discard(rid)
        msg = self.remote.pop(rid, None)
        if msg is None or rid in self.aborted:
            self.aborted.discard(rid)
            self.engine.abort(rid)
            return
        self.num_remote += 1
        self.publish(self.engine.commit_remote(rid))

    def _read_failed(self, rid: str, reason: str) -> None:
        self.reading.discard(rid)
        msg = self.remote.get(rid)
        if msg is None or rid in self.aborted:
            self.aborted.discard(rid)
            self.remote.pop(rid, None)
            self.engine.abort(rid)  # the READ is over: the blocks can be reused
            self.forget(rid)
            return
        self._fallback(rid, f"KV transfer from {msg.prefill_worker_id} failed: {reason}")

    def _fallback(self, rid: str, why: str) -> None:
        """No READ is in flight for `rid` (none started, or it is over): recompute or fail."""
        log.warning("%s: %s: %s", self.worker_id, rid, why)
        if self.policy == "recompute":
            self.remote.pop(rid)
            self.engine.recompute_remote(rid)
            self.num_recomputed += 1
            return
        self._fail(rid, why)

    def _fail(self, rid: str, why: str) -> None:
        msg = self.remote.pop(rid)
        self.engine.abort(rid)
        self.forget(rid)
        self.send_error(msg.reply_to, rid, why)

    def _release_on_sender(self, msg: KVReady) -> None:
        """Tell the prefill worker now that its blocks will not be read (else the lease
        would hold them until it expires)."""
        try:
            self.agent.connect(msg.sender)
        except (HandshakeError, TransferError) as e:
            log.warning(
                "%s: cannot reach %s to release %s: %s",
                self.worker_id,
                msg.sender.name,
                msg.request_id,
                e,
            )
        self.agent.abort(msg.request_id, peer_name=msg.sender.name)

    # -- aborts ------------------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        msg = self.remote.get(request_id)
        if msg is not None and request_id in self.reading:
            self.aborted.add(request_id)
            self.agent.abort(request_id)  # blocks are freed on the ReadFailed that follows
            self.forget(request_id)
            self.num_aborts += 1
            return
        if msg is not None:  # queued in the engine: no blocks, no READ
            del self.remote[request_id]
            self._release_on_sender(msg)
        elif request_id not in self.engine.seqs:
            self.early_aborts[request_id] = None
            while len(self.early_aborts) > MAX_EARLY_ABORTS:
                self.early_aborts.popitem(last=False)
        super().abort(request_id)

    # -- load report -------------------------------------------------------------------------
    def extra_load(self) -> dict:
        st = self.agent.stats()
        return {
            "incoming": len(self.remote) - len(self.reading),
            "reading": len(self.reading),
            "remote_prefills": self.num_remote,
            "local_prefills": self.num_local,
            "recomputed": self.num_recomputed,
            "transfer_bytes": st.bytes_read,
            "transfer_seconds": st.seconds,
            "transfer_failures": st.failures,
            "expired_leases": st.expired_leases,
            "transfer_gbps": st.gbps,
            "refused_peers": st.refused_peers,
            "rejected_frames": st.rejected_frames,
        }

    def close(self) -> None:
        super().close()
        self.agent.close()
