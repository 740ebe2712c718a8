"""What the planner needs from this router, one window at a time: `SignalRecorder`, and the
loop that pushes each window to the controller: `SignalReporter`.

Lifecycle of a window: `begin()` opens the first one (and takes the workers' prefix-cache
counters as the baseline) -> the server and its `Generation`s note events as they happen:
`note_arrival` (a generation request reached the router, whether it is then served, refused
or fails), `note_route` (the disaggregation decision: local prefills), `note_first_token`
(TTFT), `note_finished` (output lengths and TPOT of a request that finished normally) ->
`take_window(now)` closes it into a `router.signals.WindowSignals` (adding the state at its end:
the admission queue, the pools' queues and the fullest decode worker's KV) and opens the next.

Counting: arrivals are per prompt (an engine request); a request refused before its body was
read counts as one arrival of unknown length (in `arrivals`, not in `prompt_lengths`).
`finished` and `output_lengths` are per output sequence (an n > 1 request adds n). Latency
samples are kept in reservoirs of `max_samples` per window, so a busy window costs bounded
memory; their summaries' `count` is every sample seen.

Uncached prompt tokens: the workers report cumulative `prefix_hit_tokens` and
`prefix_query_tokens` (WorkerLoad.extra). Their increase over the window gives the share of
looked-up prompt tokens the prefix cache served; this router's arrived prompt tokens times the
rest is its uncached share. A share, not a plain difference, because several routers may front
the same workers: their hits are every router's. Without query counters the hits' increase is
subtracted (clamped at 0). A worker whose counter went down was restarted (its count restarts
at 0); a worker first seen after `begin()` counts from 0. Under `--routing kv-events` the router
knows more, per request: the tokens the chosen worker's cache lacks (`note_route`'s
`computed`), which the window counts for the prompts it routed; the counters' share then
covers only the rest (prompts refused or not yet routed). The counters cannot tell a decode
worker's lookups for prompts it will READ (which miss by design) from real misses; the index
can.

`SignalReporter` runs every `signal_interval_s`: it takes the window, awaits the directory's
`report_signals(router_id, window_dict)` if it has one, and fetches `planner_status()` for the
planner metrics (router/planner_status.py). Both calls have a timeout and their failures are
logged, never raised: the controller being slow or gone must not touch serving.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import random
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from engine.roles import DECODING_ROLES, PREFILL
from router.directory import READY, WorkerInfo
from router.metrics import RouterMetrics
from router.planner_status import PlannerStatus
from router.routing import LOCAL
from router.signals import LatencySummary, LengthHistogram, WindowSignals
from router.tasks import cancel_and_wait

log = logging.getLogger(__name__)

DEFAULT_MAX_SAMPLES = 2048
# The longest a report or status call may take; a shorter interval shortens it.
MAX_CALL_TIMEOUT_S = 5.0
MIN_CALL_TIMEOUT_S = 0.5
# Planner status fetches failed in a row before the last good status is no longer exported.
STALE_STATUS_MISSES = 3


class QueueState(Protocol):
    """What the recorder reads of the admission queue (router.admission.AdmissionControl)."""

    queued_requests: int
    queued_prompt_tokens: int


class Reservoir:
    """Up to `capacity` samples of a stream, each seen sample kept with equal chance
    (Vitter's algorithm R), and how many were seen."""

    __slots__ = ("capacity", "samples", "seen", "_rng")

    def __init__(self, capacity: int, rng: random.Random) -> None:
        if capacity < 1:
            raise ValueError(f"reservoir capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.samples: list[float] = []
        self.seen = 0
        self._rng = rng

    def add(self, value: float) -> None:
        self.seen += 1
        if len(self.samples) < self.capacity:
            self.samples.append(value)
            return
        j = self._rng.randrange(self.seen)
        if j < self.capacity:
            self.samples[j] = value

    def summary(self) -> LatencySummary:
        out = LatencySummary.of(self.samples)
        out.count = self.seen  # windows merge weighted by every sample, not the kept ones
        return out


def _counter(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value) if value >= 0 else None
    return None


class PrefixCounters:
    """The workers' cumulative prefix-cache counters, turned into increases per window."""

    def __init__(self) -> None:
        # worker id -> (incarnation, hit tokens, query tokens) at the last window's end; kept
        # for workers missing from a snapshot, so one odd snapshot does not recount them.
        self._last: dict[str, tuple[str, float, float]] = {}
        self._primed = False

    def prime(self, workers: Sequence[WorkerInfo]) -> None:
        """Take the current counts as the baseline (what happened before is not ours)."""
        self._last.clear()
        self._primed = False
        self.advance(workers)
        self._primed = True

    def advance(self, workers: Sequence[WorkerInfo]) -> tuple[float, float]:
        """(hit tokens, query tokens) added since the last call, over every worker."""
        hits = queries = 0.0
        for w in workers:
            extra = w.load.extra or {}
            h = _counter(extra.get("prefix_hit_tokens"))
            if h is None:
                continue
            q = _counter(extra.get("prefix_query_tokens")) or 0.0
            last = self._last.get(w.worker_id)
            if last is None or last[0] != w.incarnation:
                # New since the baseline (or replaced): its counters started at 0.
                base_h, base_q = (0.0, 0.0) if self._primed else (h, q)
            else:
                base_h, base_q = last[1], last[2]
            # A counter that went down belongs to a restarted worker: it counts from 0 again.
            hits += h - base_h if h >= base_h else h
            queries += q - base_q if q >= base_q else q
            self._last[w.worker_id] = (w.incarnation, h, q)
        return hits, queries


def uncached_tokens(arrived: int, hits: float, queries: float) -> int:
    """Arrived prompt tokens the prefix cache will not serve (see the module docstring)."""
    if queries > 0:
        return round(arrived * (1.0 - min(1.0, hits / queries)))
    return max(0, round(arrived - hits))


class SignalRecorder:
    """One planner window at a time of this router's traffic (see the module docstring)."""

    def __init__(
        self,
        workers: Callable[[], Sequence[WorkerInfo]],
        queue: QueueState,
        *,
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.time,
        max_samples: int = DEFAULT_MAX_SAMPLES,
        seed: int | None = None,
    ) -> None:
        self._workers = workers
        self._queue = queue
        self._metrics = metrics
        self._clock = clock  # wall time: the controller lines up windows of several routers
        self._max_samples = max_samples
        self._rng = random.Random(seed)
        self._prefix = PrefixCounters()
        self._reset(clock())

    def _reset(self, now: float) -> None:
        self._start = now
        self._arrivals = 0
        self._arrived_tokens = 0
        self._slot = self._slot_tokens = self._peak_1s = 0
        self._prompts = LengthHistogram()
        self._outputs = LengthHistogram()
        self._local = 0
        self._routed_tokens = self._computed_tokens = 0  # kv-events routing (note_route)
        self._finished = 0
        self._ttft = Reservoir(self._max_samples, self._rng)
        self._tpot = Reservoir(self._max_samples, self._rng)

    def begin(self, now: float | None = None) -> None:
        """Open a fresh window, with the workers' prefix counters now as the baseline."""
        self._reset(self._clock() if now is None else now)
        self._prefix.prime(self._workers())

    # ------------------------------------------------------------------ events

    def note_arrival(self, prompt_lengths: Sequence[int] | None) -> None:
        """A generation request arrived: one arrival per prompt; None for a request refused
        before its prompt was read (one arrival, length unknown)."""
        if prompt_lengths is None:
            self._arrivals += 1
            return
        self._note_slot(sum(prompt_lengths))
        hist = self._metrics.request_prompt_tokens if self._metrics is not None else None
        for n in prompt_lengths:
            self._arrivals += 1
            self._arrived_tokens += n
            self._prompts.add(n)
            if hist is not None:
                hist.observe(n)

    def _note_slot(self, tokens: int) -> None:
        """Prompt tokens per 1-s slot from the window's start; the window keeps the peak."""
        slot = max(0, int(self._clock() - self._start))
        if slot != self._slot:
            self._slot, self._slot_tokens = slot, 0
        self._slot_tokens += tokens
        self._peak_1s = max(self._peak_1s, self._slot_tokens)

    def note_route(self, path: str, prompt_tokens: int = 0, computed: int | None = None) -> None:
        """The router placed a prompt: `path` LOCAL means prefilled on its decode worker;
        `computed`: the tokens of its `prompt_tokens` the prefilling worker lacks, where the
        router knows it (KV-events routing), else None."""
        if path == LOCAL:
            self._local += 1
        if computed is not None:
            self._routed_tokens += prompt_tokens
            self._computed_tokens += max(0, min(computed, prompt_tokens))

    def note_first_token(self, ttft_s: float) -> None:
        self._ttft.add(ttft_s)

    def note_finished(self, output_lengths: Sequence[int], tpot_s: float | None) -> None:
        """A request finished normally: its choices' output lengths and its TPOT (None when
        it has no second token)."""
        hist = self._metrics.request_output_tokens if self._metrics is not None else None
        for n in output_lengths:
            self._finished += 1
            self._outputs.add(n)
            if hist is not None:
                hist.observe(n)
        if tpot_s is not None:
            self._tpot.add(tpot_s)

    # ------------------------------------------------------------------ windows

    def take_window(self, now: float | None = None) -> WindowSignals:
        """Close the current window (with the state at its end) and open the next."""
        now = self._clock() if now is None else now
        workers = list(self._workers())
        hits, queries = self._prefix.advance(workers)
        rest = max(0, self._arrived_tokens - self._routed_tokens)
        uncached = self._computed_tokens + uncached_tokens(rest, hits, queries)
        window = WindowSignals(
            start_s=self._start,
            duration_s=max(now - self._start, 1e-6),  # a clock step back must not raise
            arrivals=self._arrivals,
            prompt_lengths=self._prompts,
            output_lengths=self._outputs,
            uncached_prompt_tokens=uncached,
            local_prefills=self._local,
            finished=self._finished,
            queued_requests=self._queue.queued_requests,
            queued_prompt_tokens=self._queue.queued_prompt_tokens,
            peak_prompt_tokens_1s=self._peak_1s,
            ttft=self._ttft.summary(),
            tpot=self._tpot.summary(),
            **pool_state(workers),
        )
        if self._metrics is not None:
            self._metrics.prompt_tokens_uncached.inc(uncached)
        self._reset(now)
        return window


def pool_state(workers: Sequence[WorkerInfo]) -> dict[str, Any]:
    """The pools' queues and KV at a window's end, over READY workers (the ones the planner
    sizes; draining ones take nothing new): prefill workers' waiting requests, decode-capable
    workers' running and waiting ones, and the fullest decode-capable worker's KV usage."""
    prefill_waiting = decode_running = decode_waiting = 0
    kv_usage = 0.0
    for w in workers:
        if w.state != READY:
            continue
        load = w.load
        if w.role == PREFILL:
            prefill_waiting += max(0, int(load.num_waiting))
        elif w.role in DECODING_ROLES:
            decode_running += max(0, int(load.num_running))
            decode_waiting += max(0, int(load.num_waiting))
            total = load.num_total_blocks
            if total > 0:
                used = (total - load.num_free_blocks) / total
                kv_usage = max(kv_usage, min(1.0, max(0.0, used)))
    return {
        "prefill_waiting": prefill_waiting,
        "decode_running": decode_running,
        "decode_waiting": decode_waiting,
        "kv_usage": kv_usage,
    }


class SignalReporter:
    """Every `interval_s` (0: never): take the recorder's window, push it with the directory's
    `report_signals(router_id, window_dict)`, fetch `planner_status()`; keeps the latest good
    status. `router_id` defaults to a fresh "router-<uuid>"."""

    def __init__(
        self,
        recorder: SignalRecorder,
        directory: object,
        interval_s: float,
        router_id: str | None = None,
    ) -> None:
        if isinstance(interval_s, bool) or not interval_s >= 0:
            raise ValueError(f"interval_s must be >= 0 (0: off), got {interval_s!r}")
        self.recorder = recorder
        self.directory = directory
        # Stable for this router's life: the controller keeps each router's latest window.
        self.router_id = router_id or f"router-{uuid.uuid4().hex[:12]}"
        self.interval_s = interval_s
        self.timeout_s = min(MAX_CALL_TIMEOUT_S, max(MIN_CALL_TIMEOUT_S, interval_s))
        self.planner_status: PlannerStatus | None = None
        self._task: asyncio.Task[None] | None = None
        self._failing: set[str] = set()  # calls whose failure was logged (not again until ok)
        self._status_misses = 0  # planner_status calls failed in a row

    def start(self) -> None:
        if self.interval_s > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="router-signals")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            # Windows end every interval; a round that ran late (a slow controller) starts
            # the next interval from now instead of a burst of catch-up windows.
            next_at = max(next_at + self.interval_s, loop.time())
            await asyncio.sleep(next_at - loop.time())
            await self.tick()

    async def tick(self) -> WindowSignals:
        """One round: the window just ended, pushed; the planner status, fetched."""
        window = self.recorder.take_window()
        await asyncio.gather(self._push(window), self._fetch_status())
        return window

    async def _push(self, window: WindowSignals) -> None:
        report = getattr(self.directory, "report_signals", None)
        if report is None:
            return
        await self._call("report_signals", report, self.router_id, window.to_dict())

    async def _fetch_status(self) -> None:
        fetch = getattr(self.directory, "planner_status", None)
        if fetch is None:
            return
        ok, answer = await self._call("planner_status", fetch)
        if not ok:
            # Keep the last good status through a blip, not while the controller stays away.
            self._status_misses += 1
            if self._status_misses >= STALE_STATUS_MISSES:
                self.planner_status = None
            return
        self._status_misses = 0
        try:
            self.planner_status = PlannerStatus.from_dict(answer)
        except ValueError as e:
            self.planner_status = None
            self._failed("planner_status_check", f"bad planner status dropped: {e}")
        else:
            self._failing.discard("planner_status_check")

    async def _call(self, name: str, fn: Callable[..., Any], *args: Any) -> tuple[bool, Any]:
        """(True, result) or (False, None) after logging the failure (once until it works)."""
        try:
            result = fn(*args)
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(result, self.timeout_s)
        except TimeoutError:
            self._failed(name, f"{name} took over {self.timeout_s:g}s; skipped")
            return False, None
        except Exception as e:  # noqa: BLE001 - the controller's trouble, never the router's
            self._failed(name, f"{name} failed: {type(e).__name__}: {e}")
            return False, None
        if name in self._failing:
            self._failing.discard(name)
            log.info("router signals: %s works again", name)
        return True, result

    def _failed(self, name: str, message: str) -> None:
        if name not in self._failing:
            self._failing.add(name)
            log.warning("router signals: %s", message)
        else:
            log.debug("router signals: %s", message)
