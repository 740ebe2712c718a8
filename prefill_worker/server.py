"""The prefill worker's loop: prompts in, first token out, KV handed to a decode worker.

Lifecycle of one request (SGLang-style, from this side):
  PrefillRequest arrives -> queued in the engine (role "prefill": chunked, token budget)
  -> prefill step samples the first token -> TokenMessage(index 0) goes straight to the router
     (TTFT never waits for the transfer)
  -> blocks held under a lease for the decode worker (KVTransferAgent.hold) and KVReady sent
     to it -> the decode worker READs them and notifies -> `Released(read_done)` -> blocks freed.
  The lease expiring, an abort from either side, or the decode peer dying also end in
  `Released`, and only then are the blocks freed (nothing is freed while a READ can land).
A request whose first token already finishes it (max_tokens=1, EOS) is never handed off.
"""

from __future__ import annotations

import logging

from engine.engine_server import EngineServer
from engine.llm_engine import LLMEngine
from engine.outputs import TokenOutput
from engine.protocol import PrefillRequest
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
        super().__init__(worker_id, "prefill", engine, bind_host, max_frame_bytes)
        self.pending: dict[str, PrefillRequest] = {}  # in the engine or held for a peer
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
        else:
            super().handle(msg)

    def publish(self, outputs: list[TokenOutput]) -> None:
        super().publish(outputs)  # the first token reaches the router before any hand-off
        for out in outputs:
            req = self.pending.get(out.request_id)
            if req is None:
                continue
            if out.finish_reason is not None:
                self.pending.pop(out.request_id, None)
                continue
            self._hand_off(req, out.token_ids[0])

    def _hand_off(self, req: PrefillRequest, first_token: int) -> None:
        rid = req.request_id
        self.reply_to.pop(rid, None)  # the decode worker streams the rest
        blocks = self.engine.prefilled_blocks(rid)
        try:
            deadline = self.agent.hold(rid, blocks, req.decode_worker_id)
        except TransferError as e:
            log.error("%s: cannot hold the KV of %s: %s", self.worker_id, rid, e)
            self.engine.release(rid)
            self.pending.pop(rid, None)
            self.send_error(req.reply_to, rid, f"KV hand-off failed: {e}")
            return
        # From here the lease owns the blocks: they are freed only through a Released event.
        self.replies.send(
            req.decode_endpoint,
            KVReady(
                request_id=rid,
                prompt_token_ids=req.prompt_token_ids,
                sampling=req.sampling,
                first_token=first_token,
                reply_to=req.reply_to,
                prefill_worker_id=self.worker_id,
                sender=self.agent.agent_metadata(),
                block_ids=blocks,
                num_tokens=len(req.prompt_token_ids),
                lease_deadline=deadline,
            ),
        )
        self.num_handoffs += 1

    def has_pending_work(self) -> bool:
        return bool(self.pending)

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
            "transfer_seconds": 0.0,
            "released": dict(self.released_reasons),
        }

    def close(self) -> None:
        super().close()
        self.agent.close()
