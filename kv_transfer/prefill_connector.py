"""The prefill worker's KV connector: prompts in, first token out, KV held for a decode worker.

One record per request (`PrefillTransfer`, in `PrefillConnector.requests`), from its
`PrefillRequest` to the end of its hand-off:

    PrefillRequest -> QUEUED: in the engine (role "prefill": chunked, token budget)
      the prefill step samples the first token; the engine marks the request PREFILLED
      (blocks kept) and calls `on_prefilled`:
    -> HELD: the blocks go under a lease for the decode worker (`hold`) and a KVReady is
       built; the loop publishes the step's tokens first (TokenMessage index 0 straight to the
       router: TTFT never waits for the transfer), then `after_step` sends the KVReady and the
       request stops streaming from here
    -> the decode worker READs the blocks and notifies -> `Released(read_done)` -> the engine
       frees the blocks (`LLMEngine.release`) and the record ends.
  The lease expiring, an abort from either side, or the decode peer dying also end in
  `Released`, and only then are the blocks freed (nothing is freed while a READ can land).
  Other ends: the first token already finishes the request (max_tokens=1, EOS: never handed
  off; `request_finished`), an abort while QUEUED (the engine drops it), a lease that cannot
  be taken (`on_prefilled` refuses, the engine frees the blocks and the router gets an error
  after the step's tokens).

The split (vLLM v1's): this object decides (which request's blocks are held, for whom, when
they go back to the engine); the byte-moving half is the agent behind `KVHolder`, which
serves the decode worker's READs on its own thread.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from engine.kv_connector import Handoff
from engine.protocol import PrefillRequest
from engine.roles import PREFILL
from kv_transfer.errors import TransferError
from kv_transfer.messages import (
    AgentMetadata,
    KVReady,
    PrefixOffer,
    PrefixPull,
    Released,
    TransferEvent,
    TransferStats,
)
from kv_transfer.prefix_pull import PrefixLender, PrefixPuller

if TYPE_CHECKING:
    from engine.engine_server import ConnectorHost

log = logging.getLogger(__name__)


class KVHolder(Protocol):
    """The sender half of a `kv_transfer.agent.KVTransferAgent` (what this connector uses)."""

    def hold(self, request_id: str, block_ids: list[int], peer_name: str) -> float: ...

    def abort(self, request_id: str) -> bool: ...

    def poll(self) -> list[TransferEvent]: ...

    def num_held(self) -> int: ...

    def stats(self) -> TransferStats: ...

    def agent_metadata(self) -> AgentMetadata: ...

    def close(self) -> None: ...


class PrefillStage(enum.Enum):
    PULLING = "pulling"  # reading its prompt's leading blocks from a peer first (prefix_pull)
    QUEUED = "queued"  # in the engine, prompt not done
    HELD = "held"  # its blocks are under a lease for the decode worker
    REFUSED = "refused"  # no lease could be taken: the router is told after the step


@dataclass(slots=True)
class PrefillTransfer:
    """Everything this worker keeps for one request."""

    request: PrefillRequest
    stage: PrefillStage = PrefillStage.QUEUED
    ready: KVReady | None = None  # HELD: the hand-off, until after_step sends it
    error: str = ""  # REFUSED: what the router is told
    pins: list[int] = field(default_factory=list)  # prefix blocks kept until the prefill ends


class PrefillConnector:
    """See the module docstring. Compose it with `engine.engine_server.EngineServer`."""

    role = PREFILL

    def __init__(self, agent: KVHolder):
        self.agent = agent
        self.requests: dict[str, PrefillTransfer] = {}
        self._after_step: list[str] = []  # this step's hand-offs, sent after its tokens
        self.num_handoffs = 0
        self.released_reasons: dict[str, int] = {}
        self._host: ConnectorHost | None = None
        self.lender = PrefixLender(agent)
        self.puller = PrefixPuller(agent, self._admit)

    def attach(self, host: ConnectorHost) -> None:
        self._host = host

    # -- frames ------------------------------------------------------------------------------
    def handle(self, msg: Any) -> bool:
        host = self._host
        if isinstance(msg, PrefixOffer):
            self.puller.on_offer(host, msg)
        elif isinstance(msg, PrefixPull):
            self.lender.handle(host, msg)
        elif not isinstance(msg, PrefillRequest):
            return False
        elif msg.request_id in self.requests:
            host.send_error(
                msg.reply_to, msg.request_id, f"request id {msg.request_id!r} is already in use"
            )
        elif self.puller.start(host, msg):  # admitted when the pull is over (`_admit`)
            self.requests[msg.request_id] = PrefillTransfer(msg, PrefillStage.PULLING)
            host.stream(msg.request_id, msg.reply_to, msg.sampling.n)
        else:
            self.requests[msg.request_id] = PrefillTransfer(msg)
            self._admit(msg, [])
        return True

    def _admit(self, req: PrefillRequest, pins: list[int]) -> None:
        """Into the engine (after a prefix pull, or at once); `pins`: prefix blocks held for
        it until its prefill is over."""
        host, rid = self._host, req.request_id
        rec = self.requests.get(rid)
        try:
            if rec is None:
                raise ValueError("aborted")  # cannot happen today: an abort ends the pull
            host.engine.add_request(rid, req.prompt_token_ids, req.sampling)
        except ValueError as e:
            if pins:
                host.engine.block_manager.free(pins)
            self.requests.pop(rid, None)
            host.forget(rid)
            if rec is not None:
                host.send_error(req.reply_to, rid, str(e))
            return
        rec.stage, rec.pins = PrefillStage.QUEUED, pins
        host.stream(rid, req.reply_to, req.sampling.n)

    def _unpin(self, rec: PrefillTransfer) -> None:
        if rec.pins:
            self._host.engine.block_manager.free(rec.pins)

    # -- the engine's calls ------------------------------------------------------------------
    def on_prefilled(self, handoff: Handoff) -> bool:
        rec = self.requests.get(handoff.request_id)
        if rec is None:
            return False
        req = rec.request
        self._unpin(rec)  # the request's own table holds those blocks now
        try:
            deadline = self.agent.hold(req.request_id, handoff.block_ids, req.decode_worker_id)
        except TransferError as e:
            log.error("%s: cannot hold the KV of %s: %s", self._host.worker_id, req.request_id, e)
            rec.stage, rec.error = PrefillStage.REFUSED, f"KV hand-off failed: {e}"
            self._after_step.append(req.request_id)
            return False
        # From here the lease owns the blocks: they are freed only through a Released event.
        rec.stage = PrefillStage.HELD
        rec.ready = KVReady(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=req.sampling,
            first_token=handoff.first_token,
            reply_to=req.reply_to,
            prefill_worker_id=self._host.worker_id,
            sender=self.agent.agent_metadata(),
            block_ids=handoff.block_ids,
            num_tokens=handoff.num_tokens,
            lease_deadline=deadline,
            choices=[list(c) for c in handoff.choices] if req.sampling.n > 1 else None,
        )
        self._after_step.append(req.request_id)
        return True

    # -- the loop's calls --------------------------------------------------------------------
    def before_step(self) -> None:
        host = self._host
        for ev in self.agent.poll():
            if self.lender.on_event(host, ev) or self.puller.on_event(host, ev):
                continue
            if isinstance(ev, Released):
                self._host.engine.release(ev.request_id)
                self.requests.pop(ev.request_id, None)
                self.released_reasons[ev.reason] = self.released_reasons.get(ev.reason, 0) + 1
        self.puller.expire(host)

    def after_step(self) -> None:
        # The first tokens are out (the loop published them before this call); now the
        # hand-offs, and the errors of those that could not be held.
        host = self._host
        for rid in self._after_step:
            rec = self.requests.get(rid)
            if rec is None:
                continue
            host.forget(rid)  # the decode worker streams the rest (or nobody: an error)
            if rec.stage is PrefillStage.REFUSED:
                del self.requests[rid]
                host.send_error(rec.request.reply_to, rid, rec.error)
            elif rec.ready is not None:
                host.send(rec.request.decode_endpoint, rec.ready)
                rec.ready = None
                self.num_handoffs += 1
        self._after_step.clear()

    def abort(self, request_id: str) -> bool:
        rec = self.requests.get(request_id)
        if rec is None:
            return False
        if rec.stage is PrefillStage.PULLING:
            del self.requests[request_id]
            return self.puller.abort(self._host, request_id)
        if rec.stage is PrefillStage.HELD:
            rec.ready = None  # an abort before after_step (a failed step): never offer it
            self.agent.abort(request_id)  # blocks come back through a Released event
            return True
        del self.requests[request_id]  # QUEUED: the engine drops it and frees its blocks
        self._unpin(rec)
        return False

    def abort_unknown(self, request_id: str) -> None:
        pass  # nothing arrives here after the router's abort: a PrefillRequest comes first

    def request_finished(self, request_id: str) -> None:
        rec = self.requests.get(request_id)
        if rec is not None and rec.stage is PrefillStage.QUEUED:
            del self.requests[request_id]  # finished by its first token: no hand-off
            self._unpin(rec)

    def has_pending_work(self) -> bool:
        return bool(self.requests) or self.puller.busy()

    def holds_nothing(self) -> bool:
        return not self.requests and not self.puller.busy() and self.agent.num_held() == 0

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
            "prefix_pulls": self.puller.num_pulls,
            "prefix_pulled_blocks": self.puller.num_pulled_blocks,
            "prefix_pull_failures": self.puller.num_failed,
            "prefix_pull_bytes": st.bytes_read,
            "prefix_lent_blocks": self.lender.num_lent_blocks,
        }

    def close(self) -> None:
        self.agent.close()
