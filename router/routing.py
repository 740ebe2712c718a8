"""Routing: the pure policies that pick the workers of a request, and the pool that applies
them to the directory's current snapshot. The rules, in words, are router/README.md's
"Routing" section; each function's docstring says its part.

Policies: pure functions over a `LoadView` (the router's copy of the workers' load reports),
unit tested without sockets. `--routing affinity` (`plan_route`) guesses where a prefix lives
from a rendezvous hash of the prompt's first tokens; `--routing kv-events` (the default,
`plan_route_kv`) reads the router's KV index (router/kv_index.py, fed by the workers' KV
events; prompt blocks hashed as the engine hashes them, engine/kv_events.py): the decode
worker by batch pressure less a credit for the share of the prompt it holds, local prefill
when that worker would compute fewer than `disagg_threshold` tokens, the prefill worker by
queued plus would-be-computed tokens, and a prefix source to READ from (prefix pull).

The view is kept current between snapshots: `note_dispatch` counts a request against its
workers when it is routed, `note_ended` takes it off when it is handed off and when it ends,
and each new snapshot is brought up to date with the requests this router sent or ended
after the worker took its report (`catch_up`).

`WorkerPool` lifecycle: `start()` takes a first snapshot and starts a loop that takes one every
`refresh_interval_s`; `stop()` cancels it. A snapshot that fails or takes over
`SNAPSHOT_TIMEOUT_S` keeps the previous view (the controller may be restarting). Each snapshot
replaces the `LoadView` (READY workers only), drops the PUSH sockets of workers that left, and
fails the requests that depended on a worker that is lost: one the snapshot says is DOWN or
that came back as a new incarnation (at once), or one missing from two snapshots in a row.
An injected `finish_reason="abort"` TokenMessage ends them with 503 through the same path a
worker's own abort takes. A request depends on its decode worker from `track` to `forget`,
and on its prefill worker until `note_handed_off` (then a lost prefill worker is the decode
worker's business: its READ fails, and it recomputes or fails the request by its policy).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass

from engine.protocol import TokenMessage
from engine.roles import DECODING_ROLES, PREFILL
from router.config import RouterConfig
from router.dataplane import DataPlane
from router.directory import DOWN, READY, WorkerDirectory, WorkerInfo
from router.kv_index import KVIndex, PromptHashes
from router.kv_listener import KVEventListener
from router.tasks import cancel_and_wait

LOCAL = "local"
REMOTE = "remote"


@dataclass(slots=True)
class WorkerState:
    """Mutable load numbers of one worker (copied from its WorkerLoad)."""

    info: WorkerInfo
    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    queued_prefill_tokens: int
    block_size: int
    report_time: float | None = None  # the worker's wall clock when it took the report

    @classmethod
    def from_info(cls, info: WorkerInfo, default_block_size: int) -> WorkerState:
        load = info.load
        block_size = (
            load.extra.get("block_size", default_block_size) if load.extra else (default_block_size)
        )
        if not isinstance(block_size, int) or block_size < 1:
            block_size = default_block_size
        at = load.extra.get("time") if load.extra else None
        return cls(
            info=info,
            free_blocks=max(0, int(load.num_free_blocks)),
            total_blocks=max(0, int(load.num_total_blocks)),
            running=max(0, int(load.num_running)),
            waiting=max(0, int(load.num_waiting)),
            queued_prefill_tokens=max(0, int(load.queued_prefill_tokens)),
            block_size=block_size,
            report_time=at if isinstance(at, int | float) and math.isfinite(at) else None,
        )

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass(slots=True)
class RoutePlan:
    """Where one request goes: `prefill` is None on the local path."""

    path: str  # LOCAL | REMOTE
    decode: WorkerInfo
    prefill: WorkerInfo | None = None
    decode_hit_tokens: int = 0  # prompt tokens the decode worker holds (kv-events routing)
    prefill_hit_tokens: int = 0
    # Prompt tokens the worker that prefills will compute, as the KV index sees its cache
    # (kv-events routing; None where the router does not know: affinity routing).
    computed_tokens: int | None = None
    # Remote path: another worker whose device cache holds more of the prompt than the
    # prefill worker, and the tokens it holds: the prefill worker READs them from there.
    prefix_source: WorkerInfo | None = None
    prefix_source_tokens: int = 0
    prompt_len: int = 0  # set by `WorkerPool.route`


@dataclass(slots=True)
class Routed:
    """A request this router sent, kept a while after it ended (`LoadView.catch_up`)."""

    decode: str
    prefill: str | None
    prompt_len: int
    sent_at: float  # wall clock, as the workers' load reports carry theirs
    prefill_done_at: float | None = None  # handed off (or ended first)
    done_at: float | None = None


def _unreported(sent_at: float, ended_at: float | None, report_time: float) -> int:
    """+1 for a request a report taken at `report_time` lacks and that still runs, -1 for one
    it counts that has ended since, else 0."""
    if sent_at > report_time:
        return 1 if ended_at is None else 0
    return -1 if ended_at is not None and ended_at > report_time else 0


class NoWorkersError(RuntimeError):
    """No decode-capable worker is registered (the router answers 503)."""


class LoadView:
    """The router's current picture of the pool; replaced on every directory snapshot."""

    def __init__(self, workers: list[WorkerInfo], default_block_size: int = 16) -> None:
        self.states = {w.worker_id: WorkerState.from_info(w, default_block_size) for w in workers}

    @property
    def decode_workers(self) -> list[WorkerState]:
        return [s for s in self.states.values() if s.info.role in DECODING_ROLES]

    @property
    def prefill_workers(self) -> list[WorkerState]:
        return [s for s in self.states.values() if s.info.role == PREFILL]

    def note_dispatch(self, plan: RoutePlan, prompt_len: int) -> None:
        dec = self.states.get(plan.decode.worker_id)
        if dec is not None:
            self._add_decode(dec, prompt_len, 1)
            if plan.path == LOCAL:
                dec.queued_prefill_tokens += prompt_len
        if plan.prefill is not None and (pre := self.states.get(plan.prefill.worker_id)):
            self._add_prefill(pre, prompt_len, 1)

    def catch_up(self, routes: Iterable[Routed]) -> None:
        """Bring each report up to now: one is up to a poll and a refresh old, so it lacks the
        requests this router sent since and counts those that ended since (a conversation's
        last turn, when the next comes at once). Other routers' show in the next report."""
        for r in routes:
            dec = self.states.get(r.decode)
            if dec is not None and dec.report_time is not None:
                sign = _unreported(r.sent_at, r.done_at, dec.report_time)
                self._add_decode(dec, r.prompt_len, sign)
            pre = self.states.get(r.prefill) if r.prefill is not None else None
            if pre is not None and pre.report_time is not None:
                sign = _unreported(r.sent_at, r.prefill_done_at, pre.report_time)
                self._add_prefill(pre, r.prompt_len, sign)

    def note_ended(self, r: Routed, prefill: bool, decode: bool) -> None:
        """`r` left its prefill worker (`prefill`: handed off, or ended before) and, with
        `decode`, its decode worker too: it no longer counts against them."""
        if prefill and r.prefill is not None and (pre := self.states.get(r.prefill)):
            self._add_prefill(pre, r.prompt_len, -1)
        if decode and (dec := self.states.get(r.decode)):
            self._add_decode(dec, r.prompt_len, -1)

    @staticmethod
    def _add_decode(s: WorkerState, prompt_len: int, sign: int) -> None:
        """Count a request on (sign 1) or off (-1) decode worker `s`."""
        if sign:
            s.running = max(0, s.running + sign)
            blocks = s.free_blocks - sign * s.blocks_for(prompt_len)
            s.free_blocks = min(s.total_blocks, max(0, blocks))

    @staticmethod
    def _add_prefill(s: WorkerState, prompt_len: int, sign: int) -> None:
        """Count a request on (sign 1) or off (-1) prefill worker `s`."""
        if sign:
            s.waiting = max(0, s.waiting + sign)
            s.queued_prefill_tokens = max(0, s.queued_prefill_tokens + sign * prompt_len)


def _usage_and_pressure(state: WorkerState, batch_norm: int) -> tuple[float, float]:
    """KV usage (0-1) and batch pressure (running + 2 waiting, over `batch_norm`)."""
    usage = 1.0 - state.free_blocks / state.total_blocks if state.total_blocks > 0 else 1.0
    return usage, (state.running + 2 * state.waiting) / batch_norm


def decode_cost(state: WorkerState, prompt_len: int, batch_norm: int) -> tuple[bool, float, str]:
    """Sort key (lower is better): no room for the prompt last, then usage + batch pressure."""
    no_room = state.free_blocks < state.blocks_for(prompt_len)
    usage, pressure = _usage_and_pressure(state, batch_norm)
    return (no_room, usage + pressure, state.worker_id)


def choose_decode(
    candidates: list[WorkerState],
    prompt_len: int,
    batch_norm: int = 32,
    key: bytes | None = None,
    slack: float = 0.0,
) -> WorkerState:
    """The lowest-cost worker, or the one `key` (a `prefix_key`) hashes to while it has room
    and costs at most `slack` more."""
    if not candidates:
        raise NoWorkersError("no decode workers are available")
    cost = {s.worker_id: decode_cost(s, prompt_len, batch_norm) for s in candidates}
    least = min(candidates, key=lambda s: cost[s.worker_id])
    if key is None:
        return least
    preferred = max(candidates, key=lambda s: _rendezvous_score(key, s.worker_id))
    no_room, value, _ = cost[preferred.worker_id]
    if not no_room and value <= cost[least.worker_id][1] + slack:
        return preferred
    return least


def prefix_key(prompt_ids: list[int], prefix_tokens: int) -> bytes | None:
    """Hash of the first `prefix_tokens` ids; None for prompts too short to share a prefix."""
    if len(prompt_ids) < prefix_tokens:
        return None
    packed = struct.pack(f"<{prefix_tokens}I", *prompt_ids[:prefix_tokens])
    return hashlib.blake2b(packed, digest_size=16).digest()


def _rendezvous_score(key: bytes, worker_id: str) -> bytes:
    return hashlib.blake2b(key + worker_id.encode(), digest_size=8).digest()


def choose_prefill(
    candidates: list[WorkerState],
    prompt_ids: list[int],
    prefix_tokens: int = 64,
    slack_tokens: int = 2048,
) -> WorkerState:
    if not candidates:
        raise NoWorkersError("no prefill workers are available")

    def load(s: WorkerState) -> tuple[int, int, str]:
        return (s.queued_prefill_tokens, s.waiting, s.worker_id)

    least = min(candidates, key=load)
    key = prefix_key(prompt_ids, prefix_tokens)
    if key is None:
        return least
    preferred = max(candidates, key=lambda s: _rendezvous_score(key, s.worker_id))
    if preferred.queued_prefill_tokens <= least.queued_prefill_tokens + slack_tokens:
        return preferred
    return least


def decide_path(prompt_len: int, disagg_threshold: int, num_prefill_workers: int) -> str:
    if num_prefill_workers == 0 or prompt_len < disagg_threshold:
        return LOCAL
    return REMOTE


def plan_route(
    view: LoadView,
    prompt_ids: list[int],
    *,
    disagg_threshold: int,
    prefix_tokens: int = 64,
    slack_tokens: int = 2048,
    batch_norm: int = 32,
    decode_slack: float = 0.0,
) -> RoutePlan:
    """Pick the decode worker, then decide local vs remote prefill and pick the prefill worker."""
    key = prefix_key(prompt_ids, prefix_tokens)
    decode = choose_decode(view.decode_workers, len(prompt_ids), batch_norm, key, decode_slack)
    prefills = view.prefill_workers
    path = decide_path(len(prompt_ids), disagg_threshold, len(prefills))
    if path == LOCAL:
        return RoutePlan(LOCAL, decode.info)
    prefill = choose_prefill(prefills, prompt_ids, prefix_tokens, slack_tokens)
    return RoutePlan(REMOTE, decode.info, prefill.info)


def _hits(index: KVIndex, hashes: PromptHashes, s: WorkerState) -> tuple[int, float]:
    bs = index.block_size(s.worker_id) or s.block_size
    return index.hit_tokens(s.worker_id, hashes.get(bs), bs)


def choose_decode_kv(
    candidates: list[WorkerState],
    prompt_len: int,
    hits: dict[str, tuple[int, float]],
    batch_norm: int = 32,
    slack: float = 0.0,
) -> WorkerState:
    """The lowest batch pressure less `slack` x the tier-weighted share of the prompt held;
    KV usage is room (and the tie-break), not cost."""
    if not candidates:
        raise NoWorkersError("no decode workers are available")

    def score(s: WorkerState) -> tuple[bool, float, float, float, str]:
        no_room = s.free_blocks < s.blocks_for(prompt_len)
        held = hits.get(s.worker_id, (0, 0.0))[1] / max(1, prompt_len)
        usage, pressure = _usage_and_pressure(s, batch_norm)
        # Usage is room (and the tie-break), not cost: with small caches one conversation is a
        # fifth of a worker's KV, and a usage term sent the next turn away from its history
        # whenever the other worker ran one request less (which then READ it across).
        return (no_room, pressure - slack * held, -held, usage, s.worker_id)

    return min(candidates, key=score)


def choose_prefill_kv(
    candidates: list[WorkerState], prompt_len: int, hits: dict[str, tuple[int, float]]
) -> WorkerState:
    """Least queued prefill tokens plus the tokens it would compute for this prompt."""
    if not candidates:
        raise NoWorkersError("no prefill workers are available")

    def load(s: WorkerState) -> tuple[float, int, str]:
        compute = prompt_len - hits.get(s.worker_id, (0, 0.0))[1]
        return (s.queued_prefill_tokens + compute, s.waiting, s.worker_id)

    return min(candidates, key=load)


def plan_route_kv(
    view: LoadView,
    prompt_ids: list[int],
    index: KVIndex,
    *,
    disagg_threshold: int,
    batch_norm: int = 32,
    decode_slack: float = 0.0,
    pull: bool = True,
    hashes: PromptHashes | None = None,
) -> RoutePlan:
    """`plan_route` from the KV index: see the module docstring (`--routing kv-events`);
    `pull`: name a prefix source for the worker that prefills (kv_transfer/prefix_pull.py)."""
    hashes = hashes or PromptHashes(prompt_ids)
    n = len(prompt_ids)
    decodes, prefills = view.decode_workers, view.prefill_workers
    hits = {s.worker_id: _hits(index, hashes, s) for s in decodes + prefills}
    decode = choose_decode_kv(decodes, n, hits, batch_norm, decode_slack)
    decode_hit = hits[decode.worker_id][0]
    # Only split pools pull (a colocated replica has no KV agent to read with).
    everyone = decodes + prefills if pull and prefills else []
    source = choose_prefix_source(index, hashes, everyone, decode) if everyone else None
    # The tokens the decode worker would compute decide: what neither it holds nor it could
    # READ from the worker that holds the most.
    held = max(decode_hit, source[1] if source else 0)
    if decide_path(n - held, disagg_threshold, len(prefills)) == LOCAL:
        computed = _known(index, decode, n - held)
        plan = RoutePlan(LOCAL, decode.info, decode_hit_tokens=decode_hit, computed_tokens=computed)
        return _pulling(plan, source)
    prefill = choose_prefill_kv(prefills, n, hits)
    prefill_hit = hits[prefill.worker_id][0]
    source = choose_prefix_source(index, hashes, everyone, prefill) if everyone else None
    held = max(prefill_hit, source[1] if source else 0)
    computed = _known(index, prefill, n - held)
    plan = RoutePlan(REMOTE, decode.info, prefill.info, decode_hit, prefill_hit, computed)
    return _pulling(plan, source)


def _pulling(plan: RoutePlan, source: tuple[WorkerState, int] | None) -> RoutePlan:
    if source is not None:
        plan.prefix_source, plan.prefix_source_tokens = source[0].info, source[1]
    return plan


def choose_prefix_source(
    index: KVIndex, hashes: PromptHashes, candidates: list[WorkerState], reader: WorkerState
) -> tuple[WorkerState, int] | None:
    """The worker other than `reader` (the one that will prefill) whose cache (device and host
    tiers: a holder lends host blocks too) holds the longest leading run of the prompt, with
    the tokens it holds, when that beats `reader`'s own by a block or more (a worker with
    another block size cannot lend)."""
    bs = index.block_size(reader.worker_id) or reader.block_size
    best, most = None, index.hit_tokens(reader.worker_id, hashes.get(bs), bs)[0]
    for s in candidates:
        if s.worker_id == reader.worker_id:
            continue
        # Only blocks its events reported: blocks merely routed there may not exist yet.
        tokens = index.hit_tokens(s.worker_id, hashes.get(bs), bs, expected=False)[0]
        if tokens >= most + bs:
            best, most = s, tokens
    return (best, most) if best is not None else None


def _known(index: KVIndex, s: WorkerState, computed: int) -> int | None:
    """`computed` when the index holds the worker's cache as it is (synced), else None: a
    worker not heard from yet (or resyncing) would look like one that holds nothing."""
    return computed if index.is_synced(s.worker_id) else None


log = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 5.0
# An ended request is kept this long, to correct reports taken before it ended: far more than
# a report's age (under a second), less than a worker's health timeout.
ROUTED_KEEP_S = 10.0


class WorkerPool:
    def __init__(
        self, config: RouterConfig, directory: WorkerDirectory, dataplane: DataPlane
    ) -> None:
        self.config = config
        self.directory = directory
        self.dataplane = dataplane
        self.workers: list[WorkerInfo] = []  # every worker of the latest snapshot
        self._view = LoadView([], config.default_block_size)
        self._refresh_task: asyncio.Task[None] | None = None
        # request id -> the (worker id, incarnation) pairs it depends on, decode first
        self._inflight: dict[str, list[tuple[str, str]]] = {}
        self._gone: set[str] = set()  # workers missing from the latest snapshot
        # request id -> what this router sent, until ROUTED_KEEP_S after it ended (catch_up)
        self._routed: dict[str, Routed] = {}
        self.kv_index = KVIndex(config.kv_index_max_entries)
        self.kv_listener = (
            KVEventListener(self.kv_index, config.max_frame_bytes)
            if config.routing == "kv-events"
            else None
        )
        # Routes whose chosen worker held part of the prompt, and the tokens it held, per pool.
        self.route_hits = {"decode": 0, "prefill": 0}
        self.route_hit_tokens = {"decode": 0, "prefill": 0}

    async def start(self) -> None:
        if self.kv_listener is not None:
            await self.kv_listener.start()
        await self.refresh()
        self._refresh_task = asyncio.create_task(self._refresh_loop(), name="router-directory")

    async def stop(self) -> None:
        await cancel_and_wait(self._refresh_task)
        self._refresh_task = None
        if self.kv_listener is not None:
            await self.kv_listener.stop()

    async def refresh(self) -> None:
        horizon = time.time() - ROUTED_KEEP_S  # pruned even while snapshots fail
        for rid in [k for k, r in self._routed.items() if (r.done_at or math.inf) < horizon]:
            del self._routed[rid]
        try:
            workers = await asyncio.wait_for(self.directory.snapshot(), SNAPSHOT_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - controller may be restarting; keep last view
            log.warning("worker directory snapshot failed: %s", e)
            return
        self.workers = list(workers)
        routable = [w for w in self.workers if w.state == READY]
        self._view = LoadView(routable, self.config.default_block_size)
        self._view.catch_up(self._routed.values())
        self.dataplane.retain({w.request_endpoint for w in self.workers if w.state != DOWN})
        self._fail_orphans({w.worker_id: w for w in self.workers})
        if self.kv_listener is not None:
            self.kv_listener.sync(self.workers)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_interval_s)
            await self.refresh()

    def _fail_orphans(self, known: dict[str, WorkerInfo]) -> None:
        gone_now: set[str] = set()
        for rid, deps in list(self._inflight.items()):
            why = None
            for wid, incarnation in deps:
                why = self._lost(wid, incarnation, known.get(wid), gone_now)
                if why is not None:
                    break
            if why is not None:
                del self._inflight[rid]  # failed once; its Generation forgets it later
                self.dataplane.inject(
                    TokenMessage(rid, 0, [], finish_reason="abort", worker_id=wid, error=why)
                )
        self._gone = gone_now

    def _lost(
        self, wid: str, incarnation: str, info: WorkerInfo | None, gone_now: set[str]
    ) -> str | None:
        """Why a request that depends on worker `wid` (as `incarnation`) cannot finish, or
        None while it still can."""
        if info is None:
            gone_now.add(wid)
            return f"worker {wid} left the pool" if wid in self._gone else None
        if info.state == DOWN:
            return f"worker {wid} is down"
        if incarnation and info.incarnation != incarnation:
            return f"worker {wid} was restarted and lost the request"
        return None

    async def route(self, prompt_ids: list[int], salt: str | None = None) -> RoutePlan:
        """Pick the workers for one prompt and count it against them in the view.
        Raises NoWorkersError when no decode-capable worker is known, even after a refresh."""
        hashes = PromptHashes(prompt_ids, salt)  # per block size, once for this route
        try:
            plan = self._plan(prompt_ids, hashes)
        except NoWorkersError:
            await self.refresh()  # workers may have registered since the last poll
            plan = self._plan(prompt_ids, hashes)
        plan.prompt_len = len(prompt_ids)
        self._view.note_dispatch(plan, len(prompt_ids))
        if self.kv_listener is not None:
            self._expect(plan, hashes)
        return plan

    def _expect(self, plan: RoutePlan, hashes: PromptHashes) -> None:
        """The chosen workers will hold this prompt's blocks: the index counts them from now
        (kv_index.KVIndex.expect), before their events arrive."""
        # Only the worker that computes: a decode worker holds a remote prompt's blocks only
        # once its READ landed, after the prefill worker's step (too late to count on).
        for info in (plan.prefill or plan.decode,):
            if info is not None:
                bs = self.kv_index.block_size(info.worker_id)
                if bs:
                    self.kv_index.expect(info.worker_id, hashes.get(bs))

    def _plan(self, prompt_ids: list[int], hashes: PromptHashes) -> RoutePlan:
        cfg = self.config
        if self.kv_listener is not None:
            plan = plan_route_kv(
                self._view,
                prompt_ids,
                self.kv_index,
                hashes=hashes,
                disagg_threshold=cfg.disagg_threshold,
                batch_norm=cfg.decode_batch_norm,
                decode_slack=cfg.decode_affinity_slack,
                pull=cfg.prefix_pull,
            )
            for pool, hit in (
                ("decode", plan.decode_hit_tokens),
                ("prefill", plan.prefill_hit_tokens),
            ):
                if hit:
                    self.route_hits[pool] += 1
                    self.route_hit_tokens[pool] += hit
            return plan
        return plan_route(
            self._view,
            prompt_ids,
            disagg_threshold=cfg.disagg_threshold,
            prefix_tokens=cfg.affinity_prefix_tokens,
            slack_tokens=cfg.affinity_slack_tokens,
            decode_slack=cfg.decode_affinity_slack,
            batch_norm=cfg.decode_batch_norm,
        )

    def track(self, rid: str, plan: RoutePlan) -> None:
        self._inflight[rid] = [
            (w.worker_id, w.incarnation) for w in (plan.decode, plan.prefill) if w is not None
        ]
        prefill = plan.prefill.worker_id if plan.prefill is not None else None
        self._routed[rid] = Routed(plan.decode.worker_id, prefill, plan.prompt_len, time.time())

    def note_handed_off(self, rid: str) -> None:
        """The decode worker took `rid` over: it no longer depends on its prefill worker."""
        deps = self._inflight.get(rid)
        if deps is not None:
            del deps[1:]
        r = self._routed.get(rid)
        if r is not None and r.prefill_done_at is None:
            r.prefill_done_at = time.time()
            self._view.note_ended(r, prefill=True, decode=False)

    def forget(self, rid: str) -> None:
        self._inflight.pop(rid, None)
        r = self._routed.get(rid)
        if r is not None and r.done_at is None:
            r.done_at = time.time()
            self._view.note_ended(r, prefill=r.prefill_done_at is None, decode=True)
            r.prefill_done_at = r.prefill_done_at or r.done_at

    def role_counts(self) -> dict[str, int]:
        """Routable (READY) workers per role."""
        counts: dict[str, int] = {}
        for w in self.workers:
            if w.state == READY:
                counts[w.role] = counts.get(w.role, 0) + 1
        return counts

    def state_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for w in self.workers:
            counts[w.state] = counts.get(w.state, 0) + 1
        return counts
