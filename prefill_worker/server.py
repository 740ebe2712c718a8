"""The prefill worker's loop: prompts in, first token out, KV handed to a decode worker.

Lifecycle of one request (SGLang-style, from this side):
  PrefillRequest arrives -> queued in the engine (role "prefill": chunked, token budget)
  -> the prefill step samples the first token; the engine marks the request PREFILLED (blocks
     kept) and calls this server's `on_prefilled` (the engine's KV connector,
     engine/kv_connector.py): the blocks go under a lease for the decode worker
     (KVTransferAgent.hold) and a KVReady is queued
  -> the step's tokens are published (TokenMessage index 0 straight to the router: TTFT never
     waits for the transfer), then the KVReady goes to the decode worker
  -> the decode worker READs the blocks and notifies -> `Released(read_done)` -> blocks freed.
  The lease expiring, an abort from either side, or the decode peer dying also end in
  `Released`, and only then are the blocks freed (nothing is freed while a READ can land).
A request whose first token already finishes it (max_tokens=1, EOS) is never handed off.
"""

from __future__ import annotations

import logging

from engine.engine_server import EngineServer
from engine.kv_connector import Handoff
from engine.llm_engine import LLMEngine
from engine.protocol import PrefillRequest
from engine.roles import PREFILL
from engine.sequence import SeqStatus
from kv_transfer.agent import KVTransferAgent
from kv_transfer.errors import TransferError
from kv_transfer.events import Released
from kv_transfer.messages import KVReady

log = logging.getLogger(__name__)


class PrefillServer(EngineServer):
    def __init__(
        self,
        worker_id: str,
        engine: LLMEngine,
        agent: KVTransferAgent,
        bind_host: str = "127.0.0.1",
        max_frame_bytes: int = 16 << 20,
    ):
        self.agent = agent
        super().__init__(worker_id, PREFILL, engine, bind_host, max_frame_bytes)
        engine.set_kv_connector(self)
        self.pending: dict[str, PrefillRequest] = {}  # in the engine or held for a peer
        # Filled by on_prefilled during a step, sent after the step's tokens are published.
        self.outbox: list[tuple[str, KVReady]] = []
        self.failed_handoffs: list[tuple[PrefillRequest, str]] = []
        self.num_handoffs = 0
        self.released_reasons: dict[str, int] = {}

    def handle(self, msg) -> None:
        if isinstance(msg, PrefillRequest):
            try:
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.sampling)
            except ValueError as e:
                self.send_error(msg.reply_to, msg.request_id, str(e))
                return
            self.pending[msg.request_id] = msg
            self.reply_to[msg.request_id] = msg.reply_to
            self.open_choices[msg.request_id] = msg.sampling.n
        else:
            super().handle(msg)

    # -- the engine's KV connector (prefill half) ---------------------------------------------
    def on_prefilled(self, handoff: Handoff) -> bool:
        req = self.pending.get(handoff.request_id)
        if req is None:
            return False
        try:
            deadline = self.agent.hold(handoff.request_id, handoff.block_ids, req.decode_worker_id)
        except TransferError as e:
            log.error("%s: cannot hold the KV of %s: %s", self.worker_id, req.request_id, e)
            self.pending.pop(req.request_id, None)
            self.failed_handoffs.append((req, f"KV hand-off failed: {e}"))
            return False
        # From here the lease owns the blocks: they are freed only through a Released event.
        ready = KVReady(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=req.sampling,
            first_token=handoff.first_token,
            reply_to=req.reply_to,
            prefill_worker_id=self.worker_id,
            sender=self.agent.agent_metadata(),
            block_ids=handoff.block_ids,
            num_tokens=handoff.num_tokens,
            lease_deadline=deadline,
            choices=[list(c) for c in handoff.choices] if req.sampling.n > 1 else None,
        )
        self.outbox.append((req.decode_endpoint, ready))
        return True

    def on_remote_admitted(self, request_id: str, block_ids: list[int]) -> None:
        raise RuntimeError("a prefill engine never receives KV")

    def after_step(self) -> None:
        # The first tokens are out (publish ran before this hook); now the hand-offs.
        for endpoint, ready in self.outbox:
            self.forget(ready.request_id)  # the decode worker streams the rest
            self.replies.send(endpoint, ready)
            self.num_handoffs += 1
        self.outbox.clear()
        for req, why in self.failed_handoffs:
            self.forget(req.request_id)
            self.send_error(req.reply_to, req.request_id, why)
        self.failed_handoffs.clear()

    def finished(self, request_id: str) -> None:
        self.pending.pop(request_id, None)  # finished by its first token: no hand-off
        super().finished(request_id)

    def has_pending_work(self) -> bool:
        return bool(self.pending)

    def holds_nothing(self) -> bool:
        return not self.pending and self.agent.num_held() == 0

    def before_step(self) -> None:
        for ev in self.agent.poll():
            if isinstance(ev, Released):
                self.engine.release(ev.request_id)
                self.pending.pop(ev.request_id, None)
                self.released_reasons[ev.reason] = self.released_reasons.get(ev.reason, 0) + 1

    def abort(self, request_id: str) -> None:
        seq = self.engine.seqs.get(request_id)
        if seq is not None and seq.status == SeqStatus.PREFILLED:
            self.agent.abort(request_id)  # blocks come back through a Released event
            self.num_aborts += 1
            return
        self.pending.pop(request_id, None)
        super().abort(request_id)

    def extra_load(self) -> dict:
        st = self.agent.stats()
        return {
            "handoffs": self.num_handoffs,
            "held_requests": self.agent.num_held(),
            "expired_leases": st.expired_leases,
            "transfer_failures": st.failures,
            "transfer_bytes": st.bytes_served,
            "transfer_seconds": st.serve_seconds,
            "refused_peers": st.refused_peers,
            "rejected_frames": st.rejected_frames,
            "restarted_leases": st.restarted_leases,
            "released": dict(self.released_reasons),
        }

    def close(self) -> None:
        super().close()
        self.agent.close()
