"""The simulated cluster: the router and the pools of workers, their lifecycle and GPU-hours.

Routing (as the live router, router/routing.py, with the shared semantics of the planner):
- decode choice: among READY decode-capable workers (decode and colocated pools), those with
  KV room for the whole sequence first, then the least loaded;
- a prompt shorter than `disagg_threshold`, or any prompt when no prefill worker is READY, is
  prefilled on its decode worker (a local prefill, in mixed steps);
- prefill choice: the READY prefill worker with the fewest queued prompt tokens counting this
  prompt's uncached part there, so a worker holding the prompt's prefix wins while its queue
  is shorter than the tokens the hit saves (prefix affinity);
- with no READY decode-capable worker, requests wait at the router until one is ready.
A remote prefill's first token comes out on the prefill worker; its KV then lands on the
decode worker `profile.transfer_s(prompt)` later (a one-token request ends at its prefill).

Pools: `add_worker` asks for one (ready `startup_s` later; at once for the initial ones),
`drain` takes workers out (starting ones first, newest first; then the least loaded READY
ones); a draining worker leaves when it holds nothing. GPU-hours integrate every worker from
its ask to its leave (or the end of the run). Every change of a pool's counts is appended to
`timeline` as (time, pool, ready, starting, draining).

Machines: with `host_workers` > 1, workers are placed on machines of that many in the order
they are asked for, and the workers of one machine are each other's `peers` (their steps slow
down by `corun_slowdown[pool]` while a peer computes: workers.py).
"""

from __future__ import annotations

import math
from collections import deque

from bench.capacity_profile import CapacityProfile
from bench.prefill_cost import PrefillCost
from cluster.planner.types import COLOCATED_POOL, DECODE_POOL, POOLS, PREFILL_POOL, PoolCounts
from cluster.simulator.events import KV_LANDED, WORKER_READY, EventQueue, Flight
from cluster.simulator.prefix_cache import cached_tokens
from cluster.simulator.window import WindowRecorder
from cluster.simulator.workers import (
    DRAINING,
    GONE,
    READY,
    STARTING,
    DecodeWorker,
    PrefillWorker,
    Worker,
)
from engine.slo import ttft_target


class SimCluster:
    def __init__(
        self,
        profile: CapacityProfile,
        *,
        queue: EventQueue,
        recorder: WindowRecorder,
        disagg_threshold: int,
        startup_s: float,
        slo_ttft_s: float,
        slo_tpot_s: float,
        slo_ttft_per_1k_s: float = 0.0,
        step_by_step: bool = False,
        host_workers: int = 1,
        corun_slowdown: dict[str, float] | None = None,
        pool_gpus: dict[str, int] | None = None,
    ) -> None:
        self.profile, self.queue, self.recorder = profile, queue, recorder
        # GPUs one worker of each pool holds (its TP size): GPU-hours count them.
        self.pool_gpus = pool_gpus or dict.fromkeys(POOLS, profile.gpus_per_worker)
        self.prefill_cost = PrefillCost(profile)
        self.disagg_threshold, self.startup_s = disagg_threshold, startup_s
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.slo_ttft_per_1k_s = slo_ttft_per_1k_s
        self.step_by_step = step_by_step
        self.host_workers = host_workers
        self.corun_slowdown = dict(corun_slowdown or {})
        self.workers: list[Worker] = []  # every worker ever asked for, gone ones included
        self.ready: dict[str, list[Worker]] = {pool: [] for pool in POOLS}
        self.counts = {pool: {STARTING: 0, READY: 0, DRAINING: 0} for pool in POOLS}
        self.timeline: list[tuple[float, str, int, int, int]] = []
        self.pending: deque[Flight] = deque()  # at the router: no decode-capable worker yet
        self.finished_count = 0
        self.missed = 0  # requests known to miss the SLO so far
        self.awaiting_first = 0  # arrived, no first token yet (the router's queue)
        self.awaiting_tokens = 0  # their uncached prompt tokens (the prompt until routed)

    # -- pools --------------------------------------------------------------------------------
    def add_worker(self, pool: str, now: float, ready_now: bool = False) -> Worker:
        kind = PrefillWorker if pool == PREFILL_POOL else DecodeWorker
        worker = kind(len(self.workers), pool, self, now)
        self._place(worker)
        self.workers.append(worker)
        self._count(pool, None, STARTING, now)
        if ready_now or self.startup_s <= 0:
            self.on_ready(worker, now)
        else:
            self.queue.push(now + self.startup_s, WORKER_READY, worker)
        return worker

    def _place(self, worker: Worker) -> None:
        """Put a new worker on the current machine (or a new one when it is full)."""
        if self.host_workers <= 1:
            return
        first = len(self.workers) - len(self.workers) % self.host_workers
        worker.peers = list(self.workers[first:])
        for peer in worker.peers:
            peer.peers.append(worker)
        pool = DECODE_POOL if worker.pool == COLOCATED_POOL else worker.pool
        worker.corun_slowdown = self.corun_slowdown.get(pool, 0.0)

    def on_ready(self, worker: Worker, now: float) -> None:
        if worker.state != STARTING:
            return  # drained before it was ready
        worker.state, worker.ready_s = READY, now
        self.ready[worker.pool].append(worker)
        self._count(worker.pool, STARTING, READY, now)
        if worker.pool != PREFILL_POOL:
            while self.pending:
                self.route(self.pending.popleft(), now)

    def drain(self, pool: str, n: int, now: float) -> None:
        starting = [w for w in self.workers if w.pool == pool and w.state == STARTING]
        victims = sorted(starting, key=lambda w: -w.asked_s)
        victims += sorted(self.ready[pool], key=lambda w: (w.load(), -w.wid))
        for worker in victims[:n]:
            if worker.state == STARTING:
                self._count(pool, STARTING, None, now)
                worker.state, worker.left_s = GONE, now
                continue
            self.ready[pool].remove(worker)
            worker.state = DRAINING
            self._count(pool, READY, DRAINING, now)
            self._leave_if_done(worker, now)

    def resize(self, desired: dict[str, int], now: float) -> None:
        for pool, want in desired.items():
            have = self.counts[pool][READY] + self.counts[pool][STARTING]
            for _ in range(want - have):
                self.add_worker(pool, now)
            if want < have:
                self.drain(pool, have - want, now)

    def pool_counts(self) -> PoolCounts:
        c = self.counts
        return PoolCounts(
            ready={p: c[p][READY] for p in POOLS},
            starting={p: c[p][STARTING] for p in POOLS},
            draining={p: c[p][DRAINING] for p in POOLS},
        )

    def gpu_hours(self, end_s: float) -> float:
        gpu_seconds = sum(
            ((w.left_s if not math.isnan(w.left_s) else end_s) - w.asked_s)
            * self.pool_gpus.get(w.pool, self.profile.gpus_per_worker)
            for w in self.workers
        )
        return gpu_seconds / 3600.0

    def _count(self, pool: str, old: str | None, new: str | None, now: float) -> None:
        c = self.counts[pool]
        if old is not None:
            c[old] -= 1
        if new is not None:
            c[new] += 1
        self.timeline.append((now, pool, c[READY], c[STARTING], c[DRAINING]))

    def _leave_if_done(self, worker: Worker, now: float) -> None:
        if worker.state == DRAINING and worker.is_empty():
            worker.state, worker.left_s = GONE, now
            self._count(worker.pool, DRAINING, None, now)

    # -- the router -----------------------------------------------------------------------------
    def arrive(self, flight: Flight, now: float) -> None:
        self.awaiting_first += 1
        self.awaiting_tokens += flight.prompt_len
        self.recorder.arrival(flight)
        self.route(flight, now)

    def route(self, flight: Flight, now: float) -> None:
        decoders = self.ready[DECODE_POOL] + self.ready[COLOCATED_POOL]
        if not decoders:
            self.pending.append(flight)
            return
        need = flight.kv_need
        decode = min(decoders, key=lambda w: w.route_cost(need))
        decode.assign(flight)
        prefills = self.ready[PREFILL_POOL]
        flight.local = not prefills or flight.prompt_len < self.disagg_threshold
        hash_ids, prompt = flight.request.hash_ids, flight.prompt_len
        if flight.local:
            saved = cached_tokens(decode.cache.use(hash_ids), prompt) if hash_ids else 0
        else:
            prefill = min(prefills, key=lambda w: _prefill_cost(w, hash_ids, prompt))
            flight.prefill = prefill
            saved = cached_tokens(prefill.cache.use(hash_ids), prompt) if hash_ids else 0
        flight.uncached = flight.remaining = prompt - saved
        self.awaiting_tokens -= saved
        self.recorder.routed(flight)
        if flight.local:
            decode.join(flight, now)
        else:
            decode.inbound += 1
            prefill.enqueue(flight, now)

    # -- what workers report (the Host protocol of workers.py) ---------------------------------
    def prefill_done(self, flight: Flight, now: float) -> None:
        """A remote prefill's last chunk is computed: first token, then the KV hand-off."""
        self.first_token(flight, now)
        if flight.output_len == 1:
            flight.decode.inbound -= 1
            self.finished(flight, now)
        else:
            self.queue.push(now + self.profile.transfer_s(flight.prompt_len), KV_LANDED, flight)

    def kv_landed(self, flight: Flight, now: float) -> None:
        flight.decode.inbound -= 1
        flight.decode.join(flight, now)

    def first_token(self, flight: Flight, now: float) -> None:
        flight.first_token_s = now
        self.awaiting_first -= 1
        self.awaiting_tokens -= flight.uncached
        ttft = now - flight.request.arrival_s + self.profile.request_overhead_s
        if ttft > self._ttft_target_s(flight):
            self.missed += 1
        self.recorder.first_token(ttft)

    def finished(self, flight: Flight, now: float) -> None:
        flight.finish_s = now
        self.finished_count += 1
        tpot = tpot_s(flight, self.profile.token_overhead_s)
        # A TTFT miss was counted at the first token: count each request once.
        if tpot is not None and tpot > self.slo_tpot_s and not self._missed_ttft(flight):
            self.missed += 1
        self.recorder.finished(flight, tpot)
        decode = flight.decode
        decode.release(flight)
        if not decode.busy:
            self._leave_if_done(decode, now)

    def worker_idle(self, worker: Worker, now: float) -> None:
        self._leave_if_done(worker, now)

    def _missed_ttft(self, flight: Flight) -> bool:
        ttft = flight.first_token_s - flight.request.arrival_s + self.profile.request_overhead_s
        return ttft > self._ttft_target_s(flight)

    def _ttft_target_s(self, flight: Flight) -> float:
        """The request's TTFT target (run.SimConfig.ttft_target_s: base + per-1k allowance)."""
        return ttft_target(self.slo_ttft_s, self.slo_ttft_per_1k_s, flight.request.prompt_len)

    # -- state at a window's end (what the planner reads besides the traffic) -------------------
    def queue_state(self) -> dict[str, float]:
        decoders = [w for w in self.workers if w.pool != PREFILL_POOL and w.state in _LIVE]
        prefills = [w for w in self.workers if w.pool == PREFILL_POOL and w.state in _LIVE]
        return {
            "queued_requests": self.awaiting_first,
            "queued_prompt_tokens": self.awaiting_tokens,
            "prefill_waiting": sum(len(w.waiting) for w in prefills),
            "decode_running": sum(w.running for w in decoders),
            "decode_waiting": sum(len(w.waiting) for w in decoders),
            "kv_usage": max((w.kv_usage() for w in decoders), default=0.0),
        }


_LIVE = (READY, DRAINING)


def _prefill_cost(worker: PrefillWorker, hash_ids: tuple[int, ...], prompt: int) -> tuple:
    saved = cached_tokens(worker.cache.peek(hash_ids), prompt) if hash_ids else 0
    return worker.queued_tokens + prompt - saved, worker.wid


def tpot_s(flight: Flight, token_overhead_s: float) -> float | None:
    """Time per output token after the first (None for one-token requests)."""
    n = flight.output_len
    if n <= 1:
        return None
    return (flight.finish_s - flight.first_token_s) / (n - 1) + token_overhead_s
