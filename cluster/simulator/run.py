"""`simulate`: one trace through the simulated cluster under one scaling policy.

Lifecycle of a run: the policy's `initial()` sizes are READY at t=0 -> the loop takes the
earlier of the next trace arrival and the next heap event (workers becoming ready, KV
landing, worker steps ending, planner ticks) -> every `interval_s` the window that ended goes
to `policy.decide(now, window, pools)`, and the cluster starts or drains workers to match
(the decision and its reasons are logged) -> the run ends when every request has finished
(or, as a guard, `max_overrun_s` after the last arrival, or once `abort_after_misses`
requests missed the SLO: a sweep stops a split that can no longer reach its target) ->
`SimResult` (per-request latencies, GPU-hours, decisions, pool timeline, demand).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

from bench.capacity_profile import CapacityProfile
from cluster.planner.config import PlannerConfig
from cluster.planner.types import DECODE_POOL, PREFILL_POOL, Decision, Policy
from cluster.simulator.cluster_model import SimCluster, tpot_s
from cluster.simulator.events import (
    ARRIVAL,
    KV_LANDED,
    STEP_END,
    TICK,
    WORKER_READY,
    EventQueue,
    Flight,
)
from cluster.simulator.traces import SimRequest
from cluster.simulator.window import WindowRecorder
from cluster.simulator.workers import Worker
from engine.slo import SLO_RESULTS, SloTargets, ttft_target


@dataclass(slots=True)
class SimConfig:
    """How a run is judged and driven. `startup_s` None: the profile's."""

    slo_ttft_s: float = 1.0
    slo_tpot_s: float = 0.1
    # TTFT allowance per 1k prompt tokens (engine.slo.ttft_target: the same rule as
    # `tandem bench serve`'s goodput and the planner's sizing); 0: one target for all.
    slo_ttft_per_1k_s: float = 0.0
    interval_s: float = 10.0
    disagg_threshold: int = 0
    startup_s: float | None = None
    # Debug reference: one event per decode step (the macro-steps must give the same run).
    step_by_step: bool = False
    # Workers per machine (placed in the order they are asked for); 1: each alone (GPUs).
    host_workers: int = 1
    # A prefill / decode worker's steps take (1 + this) times as long while another worker of
    # its machine computes (shared cores and memory bandwidth: the 2-core CPU box).
    prefill_corun_slowdown: float = 0.0
    decode_corun_slowdown: float = 0.0
    # GPUs of one worker per pool (its TP size) for the GPU-hours; None: the profile's.
    prefill_gpus_per_worker: int | None = None
    decode_gpus_per_worker: int | None = None
    max_overrun_s: float = 6 * 3600.0
    abort_after_misses: int | None = None
    progress: bool = False

    def pool_gpus(self, profile_gpus: int) -> dict[str, int]:
        """Pool -> GPUs of one of its workers (`profile_gpus` where unset)."""
        return {
            PREFILL_POOL: self.prefill_gpus_per_worker or profile_gpus,
            DECODE_POOL: self.decode_gpus_per_worker or profile_gpus,
        }

    def ttft_target_s(self, prompt_len: int) -> float:
        """A request's TTFT target: the base plus the allowance for its prompt's length."""
        return ttft_target(self.slo_ttft_s, self.slo_ttft_per_1k_s, prompt_len)

    @classmethod
    def for_planner(cls, planner: PlannerConfig, **settings) -> SimConfig:
        """A run judged by the planner's own targets and driven at its interval, threshold and
        start-up time; `settings` sets the rest."""
        return cls(
            slo_ttft_s=planner.slo_ttft_s,
            slo_tpot_s=planner.slo_tpot_s,
            slo_ttft_per_1k_s=planner.slo_ttft_ms_per_1k / 1000.0,
            interval_s=planner.interval_s,
            disagg_threshold=planner.disagg_threshold,
            startup_s=planner.startup_s,
            prefill_gpus_per_worker=planner.prefill_gpus_per_worker,
            decode_gpus_per_worker=planner.decode_gpus_per_worker,
            **settings,
        )

    def __post_init__(self) -> None:
        for name in ("slo_ttft_s", "slo_tpot_s", "interval_s", "max_overrun_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be > 0, got {v}")
        if not (self.slo_ttft_per_1k_s >= 0 and math.isfinite(self.slo_ttft_per_1k_s)):
            raise ValueError(f"slo_ttft_per_1k_s must be >= 0, got {self.slo_ttft_per_1k_s}")
        if self.disagg_threshold < 0:
            raise ValueError(f"disagg_threshold must be >= 0, got {self.disagg_threshold}")
        if self.startup_s is not None and not (self.startup_s >= 0):
            raise ValueError(f"startup_s must be >= 0, got {self.startup_s}")
        if self.host_workers < 1:
            raise ValueError(f"host_workers must be >= 1, got {self.host_workers}")
        for name in ("prefill_corun_slowdown", "decode_corun_slowdown"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be >= 0, got {v}")
        if self.abort_after_misses is not None and self.abort_after_misses < 0:
            raise ValueError(f"abort_after_misses must be >= 0, got {self.abort_after_misses}")


@dataclass(slots=True)
class SimResult:
    """What a run produced. Latency lists have one entry per request in trace order: NaN
    where the request never got there (TTFT, TPOT) or has no TPOT (one output token)."""

    policy: str
    config: SimConfig
    ttft_s: list[float]
    tpot_s: list[float]
    output_lens: list[int]
    finish_s: list[float]  # simulated time of the last token
    finished: int
    end_s: float
    gpu_hours: float
    wall_s: float
    aborted: str | None = None  # why the run stopped before every request finished
    decisions: list[dict] = field(default_factory=list)
    timeline: list[tuple[float, str, int, int, int]] = field(default_factory=list)
    demand: list[dict] = field(default_factory=list)
    workers: list[dict] = field(default_factory=list)
    # Per request: (prefill worker id, decode worker id); None where it had none (yet).
    placements: list[tuple[int | None, int | None]] = field(default_factory=list)
    # Per request, its prompt length (a length-aware TTFT target needs it; empty: the base
    # target for every request).
    prompt_lens: list[int] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.ttft_s)

    def slo_results(self) -> dict[str, int]:
        """Requests per engine.slo.SLO_RESULTS (the router's `tandem_slo_requests` labels),
        judged by the router's rule; a request that never got its first token (NaN) misses
        its TTFT, one that never finished its TPOT."""
        cfg = self.config
        targets = SloTargets(
            cfg.slo_ttft_s * 1e3, cfg.slo_ttft_per_1k_s * 1e3, cfg.slo_tpot_s * 1e3
        )
        prompts = self.prompt_lens or [0] * len(self.ttft_s)
        counts = dict.fromkeys(SLO_RESULTS, 0)
        for ttft, tpot, n, p in zip(
            self.ttft_s, self.tpot_s, self.output_lens, prompts, strict=True
        ):
            counts[targets.judge(p, ttft, tpot if n > 1 else None)] += 1
        return counts

    @property
    def met(self) -> int:
        """Requests meeting both targets (unfinished ones miss)."""
        return self.slo_results()["met"]

    @property
    def attainment(self) -> float:
        return self.met / self.requests if self.requests else 1.0


def simulate(
    requests: list[SimRequest],
    profile: CapacityProfile,
    policy: Policy,
    config: SimConfig | None = None,
) -> SimResult:
    if not requests:
        raise ValueError("no requests to simulate")
    if any(b.arrival_s < a.arrival_s for a, b in zip(requests, requests[1:], strict=False)):
        raise ValueError("requests must be in arrival order")
    return _Run(requests, profile, policy, config or SimConfig()).run()


class _Run:
    def __init__(
        self, requests: list[SimRequest], profile: CapacityProfile, policy: Policy, cfg: SimConfig
    ) -> None:
        self.requests, self.profile, self.policy, self.cfg = requests, profile, policy, cfg
        self.queue = EventQueue()
        self.recorder = WindowRecorder(0.0)
        self.cluster = SimCluster(
            profile,
            queue=self.queue,
            recorder=self.recorder,
            disagg_threshold=cfg.disagg_threshold,
            startup_s=profile.startup_s if cfg.startup_s is None else cfg.startup_s,
            slo_ttft_s=cfg.slo_ttft_s,
            slo_tpot_s=cfg.slo_tpot_s,
            slo_ttft_per_1k_s=cfg.slo_ttft_per_1k_s,
            step_by_step=cfg.step_by_step,
            host_workers=cfg.host_workers,
            pool_gpus=cfg.pool_gpus(profile.gpus_per_worker),
            corun_slowdown={
                PREFILL_POOL: cfg.prefill_corun_slowdown,
                DECODE_POOL: cfg.decode_corun_slowdown,
            },
        )
        self.flights = [Flight(i, r) for i, r in enumerate(requests)]
        self.decisions: list[dict] = []
        self.demand: list[dict] = []

    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        for pool, n in self.policy.initial().items():
            for _ in range(n):
                self.cluster.add_worker(pool, 0.0, ready_now=True)
        self.queue.push(self.cfg.interval_s, TICK, None)
        now, aborted = self._loop(wall0)
        return self._result(now, aborted, time.perf_counter() - wall0)

    def _loop(self, wall0: float) -> tuple[float, str | None]:
        flights, n, queue, cluster = self.flights, len(self.flights), self.queue, self.cluster
        last_arrival = self.requests[-1].arrival_s
        deadline = last_arrival + self.cfg.max_overrun_s
        abort_after = self.cfg.abort_after_misses
        progress = _Progress(last_arrival, n, wall0) if self.cfg.progress else None
        i, now = 0, 0.0
        handlers = {
            WORKER_READY: cluster.on_ready,
            KV_LANDED: cluster.kv_landed,
            TICK: lambda _target, t: self._tick(t),
        }
        while cluster.finished_count < n:
            if abort_after is not None and cluster.missed > abort_after:
                return now, f"more than {abort_after} requests missed the SLO"
            t_next, kind = queue.peek_key()
            if i < n and (flights[i].request.arrival_s, ARRIVAL) <= (t_next, kind):
                now = flights[i].request.arrival_s
                cluster.arrive(flights[i], now)
                i += 1
                continue
            if t_next > deadline:
                return now, f"unfinished {deadline - last_arrival:.0f} s after the last arrival"
            now, kind, target, version = queue.pop()
            if kind == STEP_END:
                target.on_step_end(now, version)
            else:
                handlers[kind](target, now)
            if progress is not None:
                progress.update(now, cluster.finished_count)
        return now, None

    def _tick(self, now: float) -> None:
        window, demand = self.recorder.close(now, self.cluster.queue_state())
        pools = self.cluster.pool_counts()
        decision: Decision = self.policy.decide(now, window, pools)
        self.demand.append(demand)
        self.decisions.append(
            {
                "t": now,
                "ready": dict(pools.ready),
                "starting": dict(pools.starting),
                "draining": dict(pools.draining),
                "desired": dict(decision.desired),
                "reasons": dict(decision.reasons),
                "causes": dict(decision.causes),
                "predicted": dict(decision.predicted),
            }
        )
        self.cluster.resize(decision.desired, now)
        self.queue.push(now + self.cfg.interval_s, TICK, None)

    def _result(self, end_s: float, aborted: str | None, wall_s: float) -> SimResult:
        overhead = self.profile.request_overhead_s
        ttft, tpot = [], []
        for f in self.flights:
            ttft.append(f.first_token_s - f.request.arrival_s + overhead)
            t = tpot_s(f, self.profile.token_overhead_s) if not math.isnan(f.finish_s) else None
            tpot.append(math.nan if t is None else t)
        workers = [
            {"pool": w.pool, "asked_s": w.asked_s, "ready_s": w.ready_s, "left_s": w.left_s}
            for w in self.cluster.workers
        ]
        return SimResult(
            policy=self.policy.name,
            config=self.cfg,
            ttft_s=ttft,
            tpot_s=tpot,
            output_lens=[r.output_len for r in self.requests],
            prompt_lens=[r.prompt_len for r in self.requests],
            finish_s=[f.finish_s for f in self.flights],
            finished=self.cluster.finished_count,
            end_s=end_s,
            gpu_hours=self.cluster.gpu_hours(end_s),
            wall_s=wall_s,
            aborted=aborted,
            decisions=self.decisions,
            timeline=self.cluster.timeline,
            demand=self.demand,
            workers=workers,
            placements=[(_wid(f.prefill), _wid(f.decode)) for f in self.flights],
        )


def _wid(worker: Worker | None) -> int | None:
    return None if worker is None else worker.wid


class _Progress:
    """A line on stderr every 10% of the trace's simulated span."""

    __slots__ = ("span", "n", "wall0", "next_mark")

    def __init__(self, span_s: float, n: int, wall0: float) -> None:
        self.span, self.n, self.wall0 = max(span_s, 1e-9), n, wall0
        self.next_mark = 0.1

    def update(self, now: float, finished: int) -> None:
        if now < self.next_mark * self.span:
            return
        wall = time.perf_counter() - self.wall0
        print(
            f"simulate: t={now:.0f}s ({min(now / self.span, 9.99):.0%} of the trace), "
            f"{finished}/{self.n} finished, {wall:.1f}s wall",
            file=sys.stderr,
        )
        while self.next_mark * self.span <= now:
            self.next_mark += 0.1
