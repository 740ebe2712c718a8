"""Simulated workers: a prefill worker and a decode worker (which is also what a colocated
replica is: it prefills every request it gets, in mixed steps).

A worker's lifecycle: STARTING (asked for; GPU-hours count from here) -> READY (takes new
requests) -> DRAINING (takes none, finishes what it holds) -> GONE. A starting worker that is
drained goes straight to GONE. The cluster (cluster_model.py) owns these transitions; a
worker only runs steps and tells its host what came out of them.

Prefill worker: a FCFS queue of prompts; a step takes up to `max_batch_tokens` prompt tokens
(and `max_num_seqs` prompts), chunking the one that does not fit; a prompt's first token
comes out at the end of the step that computes its last chunk.

Decode worker: a FCFS `waiting` queue (sequences whose KV landed, and local prefills);
admission needs a sequence slot (`max_num_seqs`, prefilling ones included) and KV for the
whole sequence (prompt + output: a simulated worker never preempts). While local prefills are
admitted, each step is a mixed step: every decoding sequence emits a token and the prefills
share the rest of the token budget. Otherwise the batch runs decode steps in one event up to
its next finish (decode_batch.py); a sequence that can be admitted mid-way cuts that run at
the step then in progress.

Workers sharing a machine (`peers`: the CPU box runs a prefill and a decode worker on its two
cores, which share the memory bandwidth and the router's CPU) slow each other down: while a
peer computes, a decode step takes (1 + `corun_slowdown`) times as long, and so does a prefill
step's part that streams the weights (all but its attention, `PrefillCost.attention_s`, which
runs from the core's caches: measured, a 256-token prompt slowed by ~30% beside a decoding
batch, a 1536-token one by ~12%). A prefill step in progress is re-timed when a peer starts or
stops (its remaining work at the new rate); a decode run is cut at the step in progress, which
keeps its rate, and the next step takes the new one. Without peers (each worker on its own
GPU, the default) nothing of this runs.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from bench.capacity_profile import CapacityProfile
from bench.prefill_cost import PrefillCost
from cluster.simulator.decode_batch import DecodeBatch, decode_span_s, step_in_progress
from cluster.simulator.events import STEP_END, EventQueue, Flight
from cluster.simulator.prefix_cache import PrefixCache
from cluster.simulator.traces import BLOCK_TOKENS

STARTING, READY, DRAINING, GONE = "starting", "ready", "draining", "gone"


class Host(Protocol):
    """What a worker tells the simulated cluster."""

    profile: CapacityProfile
    prefill_cost: PrefillCost
    queue: EventQueue
    step_by_step: bool

    def prefill_done(self, flight: Flight, now: float) -> None: ...
    def first_token(self, flight: Flight, now: float) -> None: ...
    def finished(self, flight: Flight, now: float) -> None: ...
    def worker_idle(self, worker: Worker, now: float) -> None: ...


class Worker:
    """What every simulated worker has: its pool, lifecycle times and prefix cache, its step
    version (a step event whose version is stale is skipped), and the peers on its machine."""

    __slots__ = (
        "wid", "pool", "host", "state", "asked_s", "ready_s", "left_s", "cache", "busy",
        "version", "peers", "corun_slowdown", "factor",
    )  # fmt: skip

    def __init__(self, wid: int, pool: str, host: Host, asked_s: float) -> None:
        self.wid, self.pool, self.host = wid, pool, host
        self.state = STARTING
        self.asked_s, self.ready_s, self.left_s = asked_s, float("nan"), float("nan")
        self.cache = PrefixCache(host.profile.kv_capacity_tokens // BLOCK_TOKENS)
        self.busy = False  # computing a step (or about to, at this instant)
        self.version = 0
        self.peers: list[Worker] = []  # the other workers of its machine
        self.corun_slowdown = 0.0  # its steps' extra time while a peer computes
        self.factor = 1.0  # the slowdown of the step in progress

    def corun_factor(self, share: float = 1.0) -> float:
        """How much longer the step runs now: `share` of it slows by corun_slowdown while a
        peer computes."""
        if self.corun_slowdown and any(p.busy for p in self.peers):
            return 1.0 + self.corun_slowdown * share
        return 1.0

    def set_busy(self, busy: bool, now: float) -> None:
        """Start or stop computing; the peers that slow down with it re-time their steps."""
        if busy == self.busy:
            return
        self.busy = busy
        for peer in self.peers:
            if peer.corun_slowdown and peer.busy:
                peer.peer_changed(now)

    def peer_changed(self, now: float) -> None:
        """A peer started or stopped computing while this worker is busy."""
        raise NotImplementedError

    def is_empty(self) -> bool:
        raise NotImplementedError

    def load(self) -> float:
        """How busy it is, for choosing which worker to drain (least loaded first)."""
        raise NotImplementedError


class PrefillWorker(Worker):
    __slots__ = ("waiting", "queued_tokens", "_chunks", "_work_s", "_since", "_share")

    def __init__(self, wid: int, pool: str, host: Host, asked_s: float) -> None:
        super().__init__(wid, pool, host, asked_s)
        self.waiting: deque[Flight] = deque()
        self.queued_tokens = 0  # prompt tokens still to compute, the step in flight's included
        self._chunks: list[tuple[Flight, int]] = []
        self._work_s, self._since = 0.0, 0.0  # the step's work left (unslowed s), since when
        self._share = 1.0  # the share of the step a co-running peer slows down

    def is_empty(self) -> bool:
        return not self.waiting

    def load(self) -> float:
        return self.queued_tokens

    def enqueue(self, flight: Flight, now: float) -> None:
        self.waiting.append(flight)
        self.queued_tokens += flight.remaining
        if not self.busy:
            # An empty step ending now: every prompt arriving at this instant joins the first.
            self._chunks = []
            self.set_busy(True, now)
            self._end_step_after(0.0, now)

    def _start_step(self, now: float) -> None:
        profile = self.host.profile
        budget, chunks = profile.max_batch_tokens, []
        for flight in self.waiting:
            if budget == 0 or len(chunks) == profile.max_num_seqs:
                break
            take = min(flight.remaining, budget)
            chunks.append((flight, take))
            budget -= take
        self._chunks = chunks
        cost, shapes = self.host.prefill_cost, _chunk_shapes(chunks)
        work = cost.step_s(shapes)
        self._share = 1.0 - cost.attention_s(shapes) / work if work > 0 else 1.0
        self._end_step_after(work, now)

    def _end_step_after(self, work_s: float, now: float) -> None:
        """Schedule the step's end: `work_s` seconds of work at the current co-run rate."""
        self._work_s, self._since = work_s, now
        self.factor = self.corun_factor(self._share)
        self.version += 1
        self.host.queue.push(now + work_s * self.factor, STEP_END, self, self.version)

    def peer_changed(self, now: float) -> None:
        if self.corun_factor(self._share) != self.factor:
            done = (now - self._since) / self.factor
            self._end_step_after(max(self._work_s - done, 0.0), now)

    def on_step_end(self, now: float, version: int) -> None:
        if version != self.version:
            return  # re-timed: a later event ends this step
        for flight, take in self._chunks:
            flight.remaining -= take
            self.queued_tokens -= take
        self._chunks = []
        # Chunks go to the queue's head first, so the finished prompts are a prefix of it.
        while self.waiting and self.waiting[0].remaining == 0:
            self.host.prefill_done(self.waiting.popleft(), now)
        if self.waiting:
            self._start_step(now)
        else:
            self.set_busy(False, now)
            self.host.worker_idle(self, now)


class DecodeWorker(Worker):
    __slots__ = (
        "batch", "prefilling", "waiting", "inbound", "assigned", "committed_kv", "reserved_kv",
        "_step_start", "_step_k", "_chunks",
    )  # fmt: skip

    def __init__(self, wid: int, pool: str, host: Host, asked_s: float) -> None:
        super().__init__(wid, pool, host, asked_s)
        self.batch = DecodeBatch()
        self.prefilling: deque[Flight] = deque()  # admitted local prefills, FCFS
        self.waiting: deque[Flight] = deque()
        self.inbound = 0  # routed here, still prefilling elsewhere or in transfer
        self.assigned = 0  # routed here and not finished
        self.committed_kv = 0  # KV of every assigned sequence (what the router weighs)
        self.reserved_kv = 0  # KV of the admitted ones
        self._step_start, self._step_k = 0.0, 0
        self._chunks: list[tuple[Flight, int]] | None = None  # a mixed step's prefill part

    # -- what the router and the planner read ----------------------------------------------
    @property
    def running(self) -> int:
        return self.batch.size + len(self.prefilling)

    def is_empty(self) -> bool:
        return self.assigned == 0

    def load(self) -> float:
        return self.assigned

    def kv_usage(self) -> float:
        # One sequence larger than the cache may run alone: usage stays within 0..1.
        return min(1.0, self.reserved_kv / self.host.profile.kv_capacity_tokens)

    def route_cost(self, kv_need: int) -> tuple[bool, float, int]:
        """Sort key of the router's decode choice (lower first): workers with KV room for the
        sequence first, then the least loaded (KV committed + batch pressure, waiting ones
        weighing double, as router/routing.py's `decode_cost`)."""
        profile = self.host.profile
        no_room = self.committed_kv + kv_need > profile.kv_capacity_tokens
        usage = self.committed_kv / profile.kv_capacity_tokens
        pressure = (self.running + 2 * (len(self.waiting) + self.inbound)) / profile.max_num_seqs
        return no_room, usage + pressure, self.wid

    # -- sequences arriving -----------------------------------------------------------------
    def assign(self, flight: Flight) -> None:
        """The router chose this worker for `flight` (before its prefill)."""
        flight.decode = self
        self.assigned += 1
        self.committed_kv += flight.kv_need

    def release(self, flight: Flight) -> None:
        """`flight` finished (here, or on its prefill worker with its only token)."""
        self.assigned -= 1
        self.committed_kv -= flight.kv_need

    def join(self, flight: Flight, now: float) -> None:
        """A sequence ready for this worker: its KV landed, or a local prompt to prefill."""
        self.waiting.append(flight)
        if not self.busy:
            # An empty step ending now: every sequence arriving at this instant joins the first.
            self._chunks, self._step_k, self._step_start, self.factor = None, 0, now, 1.0
            self.version += 1
            self.host.queue.push(now, STEP_END, self, self.version)
            self.set_busy(True, now)
        elif self._chunks is None and self._step_k and self._can_admit_next(flight):
            self._cut(now)

    def _can_admit_next(self, flight: Flight) -> bool:
        """Would `flight` be admitted at the end of the step in progress (FCFS: only if
        nothing waits before it; nothing leaves before then, so the room is today's)?"""
        return len(self.waiting) == 1 and self._can_admit(flight)

    def _can_admit(self, flight: Flight) -> bool:
        profile = self.host.profile
        if self.running >= profile.max_num_seqs:
            return False
        # A sequence larger than the whole cache still runs, alone.
        room = self.reserved_kv + flight.kv_need <= profile.kv_capacity_tokens
        return room or self.reserved_kv == 0

    def _admit(self) -> None:
        while self.waiting and self._can_admit(self.waiting[0]):
            flight = self.waiting.popleft()
            self.reserved_kv += flight.kv_need
            if flight.local:
                self.prefilling.append(flight)
            else:
                self.batch.add(flight, emitted=1)

    def _cut(self, now: float) -> None:
        """End the decode run at the step in progress, so a new sequence joins after it."""
        batch, profile = self.batch, self.host.profile
        elapsed = (now - self._step_start) / self.factor
        k = step_in_progress(profile, batch.size, batch.context, elapsed, self._step_k)
        if k < self._step_k:
            self._step_k = k
            self.version += 1
            span = decode_span_s(profile, batch.size, batch.context, k) * self.factor
            self.host.queue.push(self._step_start + span, STEP_END, self, self.version)

    def peer_changed(self, now: float) -> None:
        # The step in progress keeps its rate; the steps after it take the new one.
        if self._chunks is None and self._step_k > 1:
            self._cut(now)

    # -- steps -------------------------------------------------------------------------------
    def _start_step(self, now: float) -> bool:
        """Start the next step (or run of decode steps); False when there is nothing to do."""
        profile, batch = self.host.profile, self.batch
        if self.prefilling:
            budget = max(1, profile.max_batch_tokens - batch.size)  # decodes use budget too
            chunks = []
            for flight in self.prefilling:
                if budget == 0:
                    break
                take = min(flight.remaining, budget)
                chunks.append((flight, take))
                budget -= take
            self._chunks, self._step_k = chunks, 1
            shapes = _chunk_shapes(chunks)
            duration = self.host.prefill_cost.mixed_step_s(shapes, batch.size, batch.context)
        elif batch.size:
            self._chunks = None
            self._step_k = 1 if self.host.step_by_step else batch.steps_to_next_finish()
            duration = decode_span_s(profile, batch.size, batch.context, self._step_k)
        else:
            return False
        self._step_start, self.factor = now, self.corun_factor()
        self.version += 1
        self.host.queue.push(now + duration * self.factor, STEP_END, self, self.version)
        return True

    def on_step_end(self, now: float, version: int) -> None:
        if version != self.version:
            return  # a run that was cut short
        host, batch = self.host, self.batch
        batch.advance(self._step_k)
        for flight in batch.pop_finished():
            self.reserved_kv -= flight.kv_need
            host.finished(flight, now)
        if self._chunks is not None:
            self._end_prefill_chunks(now)
        self._admit()
        if not self._start_step(now):
            self.set_busy(False, now)
            host.worker_idle(self, now)

    def _end_prefill_chunks(self, now: float) -> None:
        for flight, take in self._chunks:
            flight.remaining -= take
        self._chunks = None
        while self.prefilling and self.prefilling[0].remaining == 0:
            flight = self.prefilling.popleft()
            self.host.first_token(flight, now)
            if flight.output_len == 1:
                self.reserved_kv -= flight.kv_need
                self.host.finished(flight, now)
            else:
                self.batch.add(flight, emitted=1)


def _chunk_shapes(chunks: list[tuple[Flight, int]]) -> list[tuple[int, int]]:
    """(new tokens, tokens of its prompt already computed or cached) of each chunk."""
    return [(take, flight.prompt_len - flight.remaining) for flight, take in chunks]
