"""The decode worker's loop: continuous batching over requests from two sources.

Local prefill: a `GenerateRequest` runs here from prompt to last token (short prompts; the
router's conditional disaggregation).

Remote prefill (the default path), from this side:
  KVReady arrives -> queued (FIFO) until the engine has room for the prompt's blocks
  (natural backpressure: nothing is admitted that cannot be held)
  -> handshake with the sender once per pair -> blocks reserved (state REMOTE_KV) and a NIXL
     READ started -> `ReadDone` -> the sequence joins the running batch at the next step with
     the prefill worker's first token in place, and streams tokens from index 1.
  `ReadFailed` (peer died, lease expired, timeout) frees the reserved blocks and, by policy,
  recomputes the prompt here ("recompute", the default) or fails the request ("error"): a
  request is never answered from KV that did not arrive whole.
An abort while a READ is in flight cancels it and frees the blocks only once the agent reports
the READ over, so no READ can land in a block that was given to another request.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque

from engine.engine_server import EngineServer
from engine.llm_engine import LLMEngine
from kv_transfer.agent import KVTransferAgent
from kv_transfer.errors import HandshakeError, TransferError
from kv_transfer.events import ReadDone, ReadFailed
from kv_transfer.messages import KVReady

log = logging.getLogger(__name__)
FAILURE_POLICIES = ("recompute", "error")


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
        super().__init__(worker_id, "decode", engine, bind_host, max_frame_bytes)
        self.policy = on_transfer_failure
        self.incoming: deque[KVReady] = deque()
        self.reading: dict[str, KVReady] = {}
        self.aborted: set[str] = set()
        # Aborts that arrived before their KVReady (the router aborts both workers at once,
        # while the prefill worker may still be working): a late KVReady for one of these is
        # dropped and its blocks released on the sender. Bounded, oldest forgotten first.
        self.early_aborts: OrderedDict[str, None] = OrderedDict()
        self.num_remote = 0
        self.num_local = 0
        self.num_recomputed = 0

    def handle(self, msg) -> None:
        if isinstance(msg, KVReady):
            if self.early_aborts.pop(msg.request_id, False) is None:
                self._release_on_sender(msg)
                return
            self.incoming.append(msg)
        else:
            super().handle(msg)

    def add_generate(self, msg) -> None:
        self.num_local += 1
        super().add_generate(msg)

    def has_pending_work(self) -> bool:
        return bool(self.incoming or self.reading)

    def before_step(self) -> None:
        for ev in self.agent.poll():
            if isinstance(ev, ReadDone):
                self._landed(ev.request_id)
            elif isinstance(ev, ReadFailed):
                self._failed(ev.request_id, ev.reason)
        self._admit()

    def _landed(self, rid: str) -> None:
        msg = self.reading.pop(rid, None)
        if msg is None or rid in self.aborted:
            self.aborted.discard(rid)
            self.engine.abort(rid)
            return
        self.num_remote += 1
        done = self.engine.commit_remote(rid)
        if done is not None:
            self.publish([done])

    def _failed(self, rid: str, reason: str) -> None:
        msg = self.reading.pop(rid, None)
        self.engine.abort(rid)  # the READ is over: the reserved blocks can be reused
        if msg is None or rid in self.aborted:
            self.aborted.discard(rid)
            self.reply_to.pop(rid, None)
            return
        self._fallback(msg, f"KV transfer from {msg.prefill_worker_id} failed: {reason}")

    def _fallback(self, msg: KVReady, why: str) -> None:
        log.warning("%s: %s: %s", self.worker_id, msg.request_id, why)
        if self.policy == "recompute":
            try:
                self.engine.resume_request(
                    msg.request_id, msg.prompt_token_ids, [msg.first_token], msg.sampling
                )
                self.reply_to[msg.request_id] = msg.reply_to
                self.num_recomputed += 1
                return
            except ValueError as e:
                why = f"{why}; recompute refused: {e}"
        self.reply_to.pop(msg.request_id, None)
        self.send_error(msg.reply_to, msg.request_id, why)

    def _admit(self) -> None:
        while self.incoming:
            msg = self.incoming[0]
            rid = msg.request_id
            if time.time() >= msg.lease_deadline:
                self.incoming.popleft()
                self._fallback(msg, "its lease expired before this worker had room")
                continue
            try:
                self.agent.connect(msg.sender)
            except HandshakeError as e:
                self.incoming.popleft()
                self.send_error(msg.reply_to, rid, str(e))
                continue
            except TransferError as e:
                self.incoming.popleft()
                self._fallback(msg, str(e))
                continue
            try:
                blocks = self.engine.reserve_remote(
                    rid, msg.prompt_token_ids, msg.first_token, msg.sampling
                )
            except ValueError as e:
                self.incoming.popleft()
                self._release_on_sender(msg)
                self.send_error(msg.reply_to, rid, str(e))
                continue
            if blocks is None:
                return  # no room: wait for running requests to finish
            self.incoming.popleft()
            try:
                self.agent.start_read(
                    rid, msg.sender.name, msg.block_ids, blocks, msg.lease_deadline
                )
            except TransferError as e:
                self.engine.abort(rid)
                self._fallback(msg, str(e))
                continue
            self.reading[rid] = msg
            self.reply_to[rid] = msg.reply_to

    def _release_on_sender(self, msg: KVReady) -> None:
        """Tell the prefill worker now that its blocks will not be read (else the lease
        would hold them until it expires)."""
        try:
            self.agent.connect(msg.sender)
        except (HandshakeError, TransferError) as e:
            log.warning("%s: cannot reach %s to release %s: %s", self.worker_id,
                        msg.sender.name, msg.request_id, e)
        self.agent.abort(msg.request_id, peer_name=msg.sender.name)

    def abort(self, request_id: str) -> None:
        for msg in self.incoming:
            if msg.request_id == request_id:
                self.incoming.remove(msg)
                self._release_on_sender(msg)
                self.reply_to.pop(request_id, None)
                return
        if request_id in self.reading:
            self.aborted.add(request_id)
            self.agent.abort(request_id)  # blocks are freed on the ReadFailed that follows
            self.reply_to.pop(request_id, None)
            return
        if request_id not in self.engine.seqs:
            self.early_aborts[request_id] = None
            while len(self.early_aborts) > 10_000:
                self.early_aborts.popitem(last=False)
        super().abort(request_id)

    def extra_load(self) -> dict:
        st = self.agent.stats()
        return {
            "incoming": len(self.incoming),
            "reading": len(self.reading),
            "remote_prefills": self.num_remote,
            "local_prefills": self.num_local,
            "recomputed": self.num_recomputed,
            "transfer_bytes": st.bytes_read,
            "transfer_seconds": st.seconds,
            "transfer_failures": st.failures,
            "expired_leases": st.expired_leases,
            "transfer_gbps": st.gbps,
        }

    def close(self) -> None:
        super().close()
        self.agent.close()
