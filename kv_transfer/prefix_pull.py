"""Prefix pull: the worker about to prefill a prompt READs its leading blocks from a peer whose
prefix cache holds them, instead of computing them again (Mooncake's reuse across instances).

Why: a conversation's turns do not all run in one place. A turn prefilled on its decode
worker (short) leaves its KV there; the next, longer turn goes to a prefill worker that never
saw it and would recompute the whole history; a turn prefilled locally on another decode
worker than the last one's lacks what that one holds. The router's KV index knows who holds
the prompt's leading blocks; when another worker holds more of them than the worker that
will prefill, the request (`PrefillRequest` to a prefill worker, `GenerateRequest` to a
decode worker of a split pool) names it (`prefix_from`), and the reader pulls:

    reader (`PrefixPuller`)                           holder (`PrefixLender`, either pool)
    pin its own cached prefix (blocks 0..k-1)
    PrefixPull{pull_id, prompt, first_block k, ---->  pin its cached blocks k.. of the prompt
               cache_salt}                            (under that salt), hold them for the
                                                      reader (a lease)
                     <---------------------------- PrefixOffer{blocks, lease, its metadata}
    connect once per pair, allocate, NIXL READ
                      <== READ ==                     Released (read done) -> unpin
    ReadDone -> the blocks join its prefix cache (`BlockManager.adopt`), the request enters
    the engine, whose prefix lookup now finds them: only the rest is computed

Salts: both sides hash the prompt under the request's `cache_salt` (engine/kv_events.py): the
reader pins its own prefix and adopts the blocks it read under it, and the holder, told it in
the `PrefixPull`, pins only blocks cached under the same salt. A pull never moves one salt's
KV to another's request.

Both sides' blocks stay pinned until nothing can touch them: the holder's until its lease
ends (`Released`), the reader's (its own prefix and the adopted blocks) until the request's
prefill is done, so no eviction in between can waste the READ. Every failure degrades to
computing the prompt here, never to a wrong answer: no offer within `offer_timeout_s`, an
offer with no blocks, a handshake or READ that fails, no free blocks to read into. A late
offer is released at once. Pulled tokens count as prefix-cache hits (they were not computed
here), so `usage.prompt_tokens_details.cached_tokens` includes them, once.

The reader's connector admits the request through a callback once the pull is over (the
prefill connector's `_admit`, the decode connector's `_admit_local`) and frees the pinned
blocks when its prefill is over (prefill: on the hand-off; decode: when it finishes or is
aborted).

The holder lends from either tier: blocks its host pool holds past its device prefix are
copied back into device blocks first (`HostKVCache.promote_for_peer`), so the host tier is a
source of transfers too.

Not pulled: a reader at tensor parallelism > 1 (its other ranks' caches would need READ orders
of their own), a request that wants prompt logprobs (every position is computed anyway), a
gain under one block.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.protocol import GenerateRequest, PrefillRequest
from kv_transfer.errors import HandshakeError, TransferError
from kv_transfer.messages import (
    PrefixOffer,
    PrefixPull,
    ReadDone,
    ReadFailed,
    Released,
    TransferEvent,
)

if TYPE_CHECKING:
    from engine.engine_server import ConnectorHost

log = logging.getLogger(__name__)
PULL_SUFFIX = "/prefix"  # a pull's transfer id: never a request id the router makes
OFFER_TIMEOUT_S = 2.0


def pull_id_of(request_id: str) -> str:
    return request_id + PULL_SUFFIX


class PrefixLender:
    """The holder's side (a prefill or decode worker): answers `PrefixPull`s from its prefix
    cache, and unpins the blocks when the agent says their lease is over."""

    def __init__(self, agent: Any):
        self.agent = agent
        self.lent: dict[str, list[int]] = {}  # pull id -> pinned block ids
        self.num_lent_blocks = 0
        self.num_refused = 0

    def handle(self, host: ConnectorHost, msg: PrefixPull) -> None:
        blocks = self._pin(host.engine, msg.prompt_token_ids, msg.first_block, msg.cache_salt)
        bm = host.engine.block_manager
        error = "" if blocks else "this worker's prefix cache no longer holds those blocks"
        deadline = 0.0
        if blocks:
            try:
                deadline = self.agent.hold(msg.pull_id, blocks, msg.reader)
            except TransferError as e:
                bm.free(blocks)
                blocks, error = [], f"cannot hold the blocks: {e}"
        if blocks:
            self.lent[msg.pull_id] = blocks
            self.num_lent_blocks += len(blocks)
        else:
            self.num_refused += 1
        host.send(
            msg.reply_to,
            PrefixOffer(msg.pull_id, self.agent.agent_metadata(), list(blocks), deadline, error),
        )

    @staticmethod
    def _pin(engine, prompt: list[int], first: int, salt: str | None) -> list[int]:
        """The cached blocks (under the reader's `salt`) from block `first` on: the device's,
        then (with a host tier) the host pool's that continue the chain, copied back to the
        device to be read."""
        bm = engine.block_manager
        blocks = bm.pin_prefix(prompt, first, salt)
        host = getattr(engine, "host_cache", None)
        on_device = first + len(blocks)
        if host is not None and on_device == bm.num_cached_blocks(prompt, salt):
            blocks += host.promote_for_peer(prompt, on_device, salt)
        return blocks

    def on_event(self, host: ConnectorHost, ev: TransferEvent) -> bool:
        """Unpin on a lent lease's `Released`; False for events that are not ours."""
        if not isinstance(ev, Released) or ev.request_id not in self.lent:
            return False
        host.engine.block_manager.free(self.lent.pop(ev.request_id))
        return True


class PullStage(enum.Enum):
    ASKED = "asked"  # PrefixPull sent, no offer yet
    READING = "reading"  # a READ into `blocks` is in flight
    CANCELLING = "cancelling"  # aborted while reading: freed when the READ is over


@dataclass(slots=True)
class _Pull:
    request: PrefillRequest | GenerateRequest
    own: list[int]  # this worker's cached prefix blocks, pinned
    deadline: float  # monotonic: give up waiting for the offer
    stage: PullStage = PullStage.ASKED
    blocks: list[int] = field(default_factory=list)  # allocated for the READ


class PrefixPuller:
    """The reader's side (a prefill worker, or a decode worker's local prefill). `start`
    decides whether to pull before the request enters the engine; `admit` (a callback)
    puts it there once the pull is over, either way."""

    def __init__(self, agent: Any, admit, offer_timeout_s: float = OFFER_TIMEOUT_S):
        self.agent = agent
        self._admit = admit  # admit(request, pinned block ids)
        self.offer_timeout_s = offer_timeout_s
        self.pulls: dict[str, _Pull] = {}  # request id -> its pull
        self.num_pulls = 0
        self.num_pulled_blocks = 0
        self.num_failed = 0

    def start(self, host: ConnectorHost, req: PrefillRequest | GenerateRequest) -> bool:
        """Ask `req.prefix_from` for the blocks it holds beyond this worker's own prefix;
        False (and nothing pinned) when there is nothing worth pulling."""
        src, engine = req.prefix_from, host.engine
        if src is None or req.sampling.prompt_logprobs is not None:
            return False
        bm = engine.block_manager
        if getattr(engine, "tp", None) is not None or not bm.enable_prefix_caching:
            return False
        prompt, bs, salt = req.prompt_token_ids, bm.block_size, req.sampling.cache_salt
        want = min(src.tokens, len(prompt) - 1) // bs  # never the last token: its logits
        own = bm.pin_prefix(prompt[: want * bs], salt=salt)
        if want - len(own) < 1 or bm.num_free_blocks < want - len(own) + bm.blocks_needed(
            len(prompt) - want * bs + 1
        ):
            bm.free(own)
            return False
        pull = PrefixPull(
            pull_id_of(req.request_id),
            prompt[: want * bs],
            len(own),
            self.agent.name,
            host.endpoint,
            salt,
        )
        host.send(src.endpoint, pull)
        self.pulls[req.request_id] = _Pull(req, own, time.monotonic() + self.offer_timeout_s)
        self.num_pulls += 1
        return True

    # -- the offer and the READ --------------------------------------------------------------
    def on_offer(self, host: ConnectorHost, offer: PrefixOffer) -> None:
        rid = offer.pull_id.removesuffix(PULL_SUFFIX)
        pull = self.pulls.get(rid)
        if pull is None or pull.stage is not PullStage.ASKED:
            self._release_late(offer)
            return
        if not offer.block_ids:
            self._done(host, rid, f"{offer.sender.name} offered nothing: {offer.error}")
            return
        bm = host.engine.block_manager
        try:
            self.agent.connect(offer.sender)
            pull.blocks = bm.allocate_blocks(len(offer.block_ids))
        except (HandshakeError, TransferError, MemoryError) as e:
            self._release_late(offer)
            self._done(host, rid, f"cannot read from {offer.sender.name}: {e}")
            return
        try:
            self.agent.start_read(
                offer.pull_id,
                offer.sender.name,
                list(offer.block_ids),
                pull.blocks,
                offer.lease_deadline,
                sender_instance=offer.sender.instance_id,
            )
        except TransferError as e:  # nothing started: the blocks are ours to free now
            bm.free(pull.blocks)
            pull.blocks = []
            self._release_late(offer)
            self._done(host, rid, f"cannot read from {offer.sender.name}: {e}")
            return
        pull.stage = PullStage.READING

    def on_event(self, host: ConnectorHost, ev: TransferEvent) -> bool:
        """A pull's ReadDone / ReadFailed; False for events that are not ours."""
        if not isinstance(ev, ReadDone | ReadFailed) or not ev.request_id.endswith(PULL_SUFFIX):
            return False
        rid = ev.request_id.removesuffix(PULL_SUFFIX)
        pull = self.pulls.get(rid)
        if pull is None or pull.stage is PullStage.ASKED:
            return True
        bm = host.engine.block_manager
        if pull.stage is PullStage.CANCELLING:
            del self.pulls[rid]
            bm.free(pull.blocks)
            bm.free(pull.own)
            return True
        if isinstance(ev, ReadFailed):
            bm.free(pull.blocks)
            pull.blocks = []
            self._done(host, rid, f"the READ failed: {ev.reason}")
            return True
        req = pull.request
        bm.adopt(pull.blocks, req.prompt_token_ids, len(pull.own), req.sampling.cache_salt)
        self.num_pulled_blocks += len(pull.blocks)
        self._done(host, rid, "")
        return True

    def expire(self, host: ConnectorHost) -> None:
        """Pulls whose offer did not come in time go ahead without it."""
        now = time.monotonic()
        for rid, pull in list(self.pulls.items()):
            if pull.stage is PullStage.ASKED and now >= pull.deadline:
                self._done(host, rid, "no offer in time")

    def _done(self, host: ConnectorHost, rid: str, failure: str) -> None:
        pull = self.pulls.pop(rid)
        if failure:
            self.num_failed += 1
            log.info("%s: prefix pull for %s: %s; computing it", host.worker_id, rid, failure)
        self._admit(pull.request, pull.own + pull.blocks)

    def _release_late(self, offer: PrefixOffer) -> None:
        """An offer nobody will read (late, or not usable): free the holder's lease now."""
        if not offer.block_ids:
            return
        try:
            self.agent.connect(offer.sender)
        except (HandshakeError, TransferError) as e:
            log.warning("cannot reach %s to release %s: %s", offer.sender.name, offer.pull_id, e)
        self.agent.abort(offer.pull_id, peer_name=offer.sender.name)

    # -- aborts ------------------------------------------------------------------------------
    def abort(self, host: ConnectorHost, request_id: str) -> bool:
        """Drop a request still pulling; True if it was (its READ, if any, is cancelled and
        its blocks come back when the READ is over)."""
        pull = self.pulls.get(request_id)
        if pull is None:
            return False
        if pull.stage is PullStage.READING:
            pull.stage = PullStage.CANCELLING
            self.agent.abort(pull_id_of(request_id))
        elif pull.stage is PullStage.ASKED:
            del self.pulls[request_id]  # a late offer is released when it comes
            host.engine.block_manager.free(pull.own)
        return True

    def busy(self) -> bool:
        return bool(self.pulls)
