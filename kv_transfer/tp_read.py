"""READs by a tensor-parallel receiver's other ranks: rank 0 orders, each rank's own NIXL agent
READs its KV heads into its own cache, and rank 0 learns when they landed or failed.

Rank 0 keeps every decision (which blocks, leases and renewals, the side channel, failures);
the other ranks' agents (registered by tp_rank.rank_hook) only post and check READs. Lifecycle
of one sender and one request, as rank 0's `RankReads` (driven by receiver.Receiver) sees it:

    connect(peer, reply)   RankConnect: each rank plans its own slices of the sender's layout
                           (handshake.slice_plan for its rank: a replicated head from one
                           holder), loads the NIXL agents of the sender ranks it reads from
                           and warms each pair up with one row
    start(rid, ...)        RankRead: each rank posts one READ per slice, no notification ->
                           DONE (on CPU UCX copies inside the post) | PROC | ERR
    poll(rids)             RankPoll: DONE once every rank's READs landed (a rank releases a
                           landed read and remembers it as DONE), ERR naming the rank, else PROC
    cancel(rid)            RankPoll(cancel): each rank releases (cancels) its READs of rid;
                           True only once none can still land
    forget(peer)           RankForget: cancel that sender's reads on the ranks, unload its agents

Rank 0 posts its own READs only after `start`/`poll` said DONE, its last one carrying
`ReadComplete`: the sender frees the blocks only once every rank's READ has landed. Any
rank's failure (or the group down: TPError) fails the whole read, and rank 0 reports it only
once `cancel` confirmed no rank READ can land. A rank whose process is gone holds no memory a
READ could land in, and a group that raised TPError never steps again, so then cancel is done.

Transport: `engine.distributed.TPGroup.run_hook`, JSON carrying a typed frame (msgpack,
base64) each way; nothing pickled. A hook uses the group the forward pass uses, so orders go
only from the thread that steps the engine (the one that called `connect`); a cancel or forget
asked from another thread (a new allowed map) waits for that thread's next `poll`.
"""

from __future__ import annotations

import base64
import collections
import logging
import threading
from typing import Annotated

import numpy as np
from msgspec import Meta

from engine.protocol import MAX_IDS, Count, Frame, Name, RequestId, decode, encode, message
from kv_transfer.errors import HandshakeError, quietly
from kv_transfer.faults import FaultPlan, ReadFaults
from kv_transfer.handshake import slice_plan
from kv_transfer.messages import MAX_SIDE_FRAME_BYTES, HelloReply, Message, RequestIds
from kv_transfer.nixl import check_block_ids
from kv_transfer.tp_rank import endpoint

log = logging.getLogger(__name__)

MAX_ORDER_BYTES = 1 << 19  # under engine.distributed.MAX_HOOK_BYTES once base64'd and in JSON
BlockIds = Annotated[list[Count], Meta(min_length=1, max_length=MAX_IDS)]
DONE, PROC, GONE, RELEASED = "DONE", "PROC", "GONE", "RELEASED"
_FINISHED_KEPT = 4096  # landed reads a rank still answers DONE for


@message("kvx.rank_connect")
class RankConnect(Frame):
    name: Name  # rank 0's agent name; rank r's agent is tp_rank.agent_name(name, r)
    peer: Name
    reply: Annotated[bytes, Meta(min_length=1, max_length=MAX_SIDE_FRAME_BYTES)]  # HelloReply
    timeout_s: Annotated[float, Meta(gt=0, le=600)]
    warmup: bool = True
    # rank 0's FaultPlan (faults.py), tests only: each rank applies its receiver knobs to its
    # own READs with counters of its own (fail_reads=1 fails each rank's first READ post).
    faults: Annotated[dict[str, float | int | bool], Meta(max_length=16)] = {}


@message("kvx.rank_read")
class RankRead(Frame):
    name: Name
    request_id: RequestId
    peer: Name
    remote_block_ids: BlockIds
    local_block_ids: BlockIds

    def check(self) -> None:
        if len(self.remote_block_ids) != len(self.local_block_ids):
            raise ValueError("remote and local block ids differ in number")


@message("kvx.rank_poll")
class RankPoll(Frame):
    name: Name
    request_ids: RequestIds
    cancel: bool = False  # release (cancel) these reads instead of checking them


@message("kvx.rank_forget")
class RankForget(Frame):
    name: Name
    peer: Name


@message("kvx.rank_states")
class RankStates(Frame):
    """A rank's answer: per request id (or "" for a connect) DONE | PROC | GONE | RELEASED |
    "ERR <why>"."""

    states: Annotated[dict[Annotated[str, Meta(max_length=256)], Message], Meta(max_length=4096)]
    landed_bytes: Annotated[dict[RequestId, Count], Meta(max_length=4096)] = {}  # DONE ones


# ---------------------------------------------------------------------- on ranks 1..N-1

_PEERS: dict[tuple[str, str], tuple[object, list[str]]] = {}  # (name, peer) -> plan, agents
_READS: dict[tuple[str, str], tuple[str, list, int]] = {}  # (name, rid) -> peer, handles, bytes
_FINISHED: collections.OrderedDict[tuple[str, str], int] = collections.OrderedDict()  # -> bytes
_OPS: dict[str, object] = {}  # name -> the rank's post/check/release (NIXL's, or ReadFaults')


def rank_hook(cache, rank: int, arg: dict) -> dict:
    """One order from rank 0, run on this rank (engine.distributed._run_hook)."""
    order = decode(base64.b64decode(arg["order"]), MAX_ORDER_BYTES)
    try:
        nixl = endpoint(order.name, rank)
        if isinstance(order, RankConnect):
            states = {"": _connect(nixl, rank, order)}
        elif isinstance(order, RankRead):
            states = {order.request_id: _read(nixl, order)}
        elif isinstance(order, RankPoll):
            one = _cancel if order.cancel else _poll
            states = {rid: one(nixl, (order.name, rid)) for rid in order.request_ids}
        elif isinstance(order, RankForget):
            _forget(nixl, order.name, order.peer)
            states = {"": DONE}
        else:
            raise ValueError(f"not a rank order: {type(order).__name__}")
    except Exception as e:  # noqa: BLE001 - NIXL's own errors too: an answer, not a dead group
        key = getattr(order, "request_id", "")
        states = {key: f"ERR {type(e).__name__}: {e}"}
    name = getattr(order, "name", "")
    landed = {r: _FINISHED[(name, r)] for r, st in states.items() if st == DONE and r}
    reply = RankStates(states, {r: n for r, n in landed.items() if n})
    return {"reply": base64.b64encode(encode(reply)).decode()}


def _connect(nixl, rank: int, order: RankConnect) -> str:
    reply = decode(order.reply, MAX_SIDE_FRAME_BYTES, expect=HelloReply)
    if order.name not in _OPS:  # bound once per agent, like the receiver's (faults.py)
        plan = FaultPlan.from_dict(order.faults) if order.faults else None
        _OPS[order.name] = ReadFaults(plan, nixl) if plan and plan.on_receiver else nixl
    _forget(nixl, order.name, order.peer)  # a new instance of the sender replaces the old
    plan = slice_plan(order.peer, reply, nixl.spec, nixl.region, rank)
    metadata = {0: reply.nixl_metadata} | {r.rank: r.nixl_metadata for r in reply.ranks}
    added: list[str] = []
    try:
        for src_rank in sorted({s.src_rank for s in plan.slices}):
            src = plan.sources[src_rank]
            added.append(nixl.add_peer(metadata[src_rank]))
            if added[-1] != src.name:
                raise ValueError(f"the NIXL metadata of {src.name!r} names {added[-1]!r}")
            if order.warmup:
                row = [[src.data_base, plan.src.entry_bytes, src.device_id]]
                state = nixl.warm_up_rows(src.name, np.array(row, np.uint64), order.timeout_s)
                if state != DONE:
                    raise ValueError(f"warm-up READ of {src.name} ended {state}")
    except BaseException:
        for agent in added:
            nixl.forget_peer(agent, None)
        raise
    _PEERS[(order.name, order.peer)] = (plan, added)
    return DONE


def _read(nixl, order: RankRead) -> str:
    key = (order.name, order.request_id)
    if key in _READS:
        raise ValueError("a read of this request is in progress on this rank")
    _FINISHED.pop(key, None)  # a request id seen before: this read's state is its own
    entry = _PEERS.get((order.name, order.peer))
    if entry is None:
        raise ValueError(f"not connected to {order.peer!r}")
    plan, _ = entry
    local = list(check_block_ids(order.request_id, order.local_block_ids, nixl.region.num_blocks))
    handles: list = []
    _READS[key] = (order.peer, handles, 0)
    for s in plan.slices:
        mine, theirs = plan.rows(s, order.remote_block_ids, local)
        _READS[key] = (order.peer, handles, _READS[key][2] + int(mine[:, 1].sum()))
        handles.append(nixl.make_rows_read(mine, theirs, plan.sources[s.src_rank].name, b""))
        state = _OPS[order.name].transfer(handles[-1])
        if state.startswith("ERR"):
            return f"ERR NIXL could not post the READ: {state}"
    return _poll(nixl, key)


def _poll(nixl, key: tuple[str, str]) -> str:
    if key in _FINISHED:
        return DONE
    entry = _READS.get(key)
    if entry is None:
        return GONE
    states = [_OPS[key[0]].check(h) for h in entry[1]]
    bad = [s for s in states if s not in (DONE, PROC)]
    if bad:
        return f"ERR NIXL READ failed: {bad[0]}"
    if PROC in states:
        return PROC
    nbytes = entry[2]
    if _cancel(nixl, key) == RELEASED:
        _FINISHED[key] = nbytes
        while len(_FINISHED) > _FINISHED_KEPT:
            _FINISHED.popitem(last=False)
        return DONE
    return PROC


def _cancel(nixl, key: tuple[str, str]) -> str:
    """Release every READ handle of `key` (cancelling one in flight)."""
    if key in _FINISHED:
        return RELEASED
    entry = _READS.get(key)
    if entry is None:
        return GONE
    peer, handles, _ = entry
    handles[:] = [h for h in handles if not _OPS[key[0]].release(h, key[1])]
    if handles:  # NIXL refused: a dead sender's requests go once its agents are unloaded
        plan_agents = _PEERS.pop((key[0], peer), (None, []))[1]
        for agent in plan_agents:
            nixl.forget_peer(agent, None)
        handles[:] = [h for h in handles if not _OPS[key[0]].release(h, key[1])]
    if handles:
        return "UNRELEASED"
    del _READS[key]
    return RELEASED


def _forget(nixl, name: str, peer: str) -> None:
    for key in [k for k, (p, _, _) in _READS.items() if k[0] == name and p == peer]:
        _cancel(nixl, key)
    _, agents = _PEERS.pop((name, peer), (None, []))
    for agent in agents:
        nixl.forget_peer(agent, None)


# ---------------------------------------------------------------------- on rank 0


class RankReads:
    """Rank 0's orders to the other ranks of its TP group (see the module docstring)."""

    def __init__(self, tp_group, name: str, timeout_s: float, warmup: bool, faults=None):
        self.size = tp_group.size
        self._tp, self._name = tp_group, name
        self._timeout_s, self._warmup = timeout_s, warmup
        self._faults = faults.to_dict() if faults is not None and faults.on_receiver else {}
        self._owner: int | None = None  # the thread that steps the engine
        self._landed: dict[str, dict[int, int]] = {}  # rid -> rank -> bytes its READs moved
        self._forgets: list[str] = []

    def _order(self, frame: Frame) -> list[dict[str, str]]:
        """Run `frame` on ranks 1..N-1; their answers in rank order. Raises TPError."""
        answers = self._tp.run_hook(__name__, {"order": base64.b64encode(encode(frame)).decode()})
        replies = [decode(base64.b64decode(a["reply"]), expect=RankStates) for a in answers]
        for rank, reply in enumerate(replies, start=1):
            for rid, n in reply.landed_bytes.items():
                self._landed.setdefault(rid, {})[rank] = n
        return [r.states for r in replies]

    def landed_bytes(self, rid: str) -> int:
        """Bytes the other ranks' READs of `rid` moved (counted from their descriptors)."""
        return sum(self._landed.pop(rid, {}).values())

    def _mine(self) -> bool:
        if self._owner != threading.get_ident():
            return False
        while self._forgets:
            self._send_forget(self._forgets.pop())
        return True

    def connect(self, peer: str, reply: HelloReply) -> None:
        """Every other rank ready to READ its heads from sender `peer`; else HandshakeError."""
        from engine.distributed import TPError

        self._owner = threading.get_ident()
        self._mine()
        frame = RankConnect(
            self._name, peer, encode(reply), self._timeout_s, self._warmup, self._faults
        )
        try:
            answers = self._order(frame)
        except TPError as e:
            raise HandshakeError(peer, f"our tensor-parallel ranks are down: {e}") from e
        for rank, states in enumerate(answers, start=1):
            if states.get("") != DONE:
                self._send_forget(peer)
                raise HandshakeError(peer, f"our rank {rank} could not connect: {states}")

    def start(self, rid: str, peer: str, remote: list[int], local: list[int]) -> str:
        """Post every other rank's READs of `rid`: DONE, PROC or "ERR <why>"."""
        from engine.distributed import TPError

        try:
            answers = self._order(RankRead(self._name, rid, peer, remote, local))
        except TPError as e:
            return f"ERR {e}"
        return _combine(rid, answers)

    def poll(self, rids: list[str]) -> dict[str, str]:
        """The ranks' READs of `rids` (PROC for all when called off the owner thread)."""
        from engine.distributed import TPError

        if not self._mine():
            return {rid: PROC for rid in rids}
        try:
            answers = self._order(RankPoll(self._name, rids))
        except TPError as e:
            return {rid: f"ERR {e}" for rid in rids}
        return {rid: _combine(rid, answers) for rid in rids}

    def cancel(self, rid: str) -> bool:
        """True once no rank READ of `rid` can land; False: ask again at the next poll."""
        from engine.distributed import TPError

        if not self._mine():
            return False
        try:
            answers = self._order(RankPoll(self._name, [rid], cancel=True))
        except TPError as e:  # no rank process, or a group that never steps again
            log.warning("cancelling the rank READs of %s: %s", rid, e)
            answers = []
        if all(a.get(rid) in (RELEASED, GONE) for a in answers):
            self._landed.pop(rid, None)
            return True
        return False

    def forget(self, peer: str) -> None:
        """Unload sender `peer` on every rank (later, from the owner thread)."""
        if self._owner is None:
            return  # never connected: the ranks know no sender
        if self._owner == threading.get_ident():
            self._send_forget(peer)
        else:
            self._forgets.append(peer)

    def _send_forget(self, peer: str) -> None:
        quietly(lambda: self._order(RankForget(self._name, peer)))


def _combine(rid: str, answers: list[dict[str, str]]) -> str:
    """One state from every rank's: the first error (naming the rank), else PROC, else DONE."""
    states = [a.get(rid, GONE) for a in answers]
    for rank, state in enumerate(states, start=1):
        if state.startswith("ERR"):
            return f"ERR our rank {rank}: {state[4:]}"
        if state == GONE:
            return f"ERR our rank {rank} has no READ of {rid}"
    return PROC if PROC in states else DONE
