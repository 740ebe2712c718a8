"""`Planner`: the pure policy that sizes the prefill and decode pools each interval.

Lifecycle of one `decide(now, window, pools)`:

1. observe: the window joins the demand history (rate forecast, length mix, queues);
2. correct: where the window is fair evidence (enough samples, no worker starting, draining or
   just changed, no backlog the model already explains), the capacity factor that makes the
   model predict the observed TTFT p90 / TPOT p50 is blended into that pool's correction
   (EWMA, clamped per step and overall); without evidence the correction decays toward 1;
3. size: `plans.plan_pools` for the demand expected when a worker asked for now would be
   ready (up: the forecast plus its noise, or a burst's own rate and length mix where the
   burst's work outlives a start-up; down: the forecast plus a margin that grows with the
   noise), with only the queues the ready and starting workers leave (`backlog.py`),
   conditional disaggregation included;
4. step each pool: up at once (after `up_cooldown_s`), counting starting workers as there;
   down by at most `down_step` only after `down_stable_windows` windows in a row wanted fewer,
   `down_cooldown_s` after the pool's last change, not below the peaks of `down_hold_s` nor
   (decode) to a size it grew back from within `REVERSAL_MEMORY_S`, and never while it has a
   backlog; min/max always; then the GPU budget (`fit_budget`),
   draining workers included.

`desired` is the number of workers each pool should have once start-ups finish (ready plus
starting, draining excluded). Every decision says why per pool (`reasons`, `causes`) and what
the planner predicts at the desired sizes (`predicted`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

from bench.capacity_profile import CapacityProfile
from router.signals import WindowSignals

from .backlog import residual_decode, residual_prefill, serving_until_ready
from .config import PlannerConfig
from .correction import (
    CORRECTION_RANGE,
    PREFILL_FLOOR,
    blend,
    relax,
    solve_decode,
    solve_prefill,
)
from .demand import DemandTracker, LengthDist, Workload, queue_share
from .plans import (
    Bounds,
    PoolPlan,
    burst_holds,
    fit_budget,
    plan_pools,
)
from .reasons import explain, tokens
from .sizing import (
    Corrections,
    Targets,
    decode_load,
    decode_tpot_p50,
    local_ttft_p90,
    prefill_load,
    prefill_ttft_p90,
)
from .types import DECODE_POOL, PREFILL_POOL, Decision, PoolCounts

POOLS = (PREFILL_POOL, DECODE_POOL)
MAX_LOCAL_SHARE = 0.2  # above it, TTFT p90 is not the prefill pool's alone: no evidence
# TTFTs are evidence only with at least 1/this arrivals per first token in the window (steady
# traffic: about one first token per arrival; the window after traffic stops: many per arrival).
ARRIVALS_PER_SAMPLE = 2
LATENCY_FACTOR = 1.1  # an up with a correction above this is put down to observed latency
# Under a loose TTFT target (room to queue for more than a window), a TTFT p90 under this
# share of the goal is no prefill evidence: the prefill factor only adds workers, and there
# the queue, not slow GPUs, sets the p90 (prefix-affinity routing queues unevenly, which the
# M/G/P model does not see), far from any miss.
EVIDENCE_TTFT_SHARE = 0.5
# A decode pool that had to grow back within this long of a cut to N workers does not go
# down to N again for this long: the acceptance's oscillation window (one turn per pool per
# 10 minutes). On ServeGen's 10:00 hour (bursty clients) the decode pool went 2 -> 1 -> 2
# five times in ten minutes, each time with queued sequences and TPOT misses (98.3% -> 99.7%
# attainment with the memory). The prefill pool's reversals come from bursts, which the burst
# hold already weighs; remembered there too they cost conv x20 1.3 points of GPU-hours and
# held-out code x5 12 (benchmarks/README.md).
REVERSAL_MEMORY_S = 600.0
# The warm start is the one decision no window has checked, and a decode pool short of KV is a
# start-up of misses from repair: it keeps room for this many SDs of the KV its sequences hold
# (sizing.kv_batch). At the mean, 58 req/s of chat on two workers' 98% of KV stalled (the
# synthetic clumps: 521 TPOT misses until a third served; static 5:2 attains 14%).
WARM_KV_SIGMAS = 2.0


@dataclass(slots=True)
class PoolState:
    last_change_s: float = -math.inf
    down_streak: int = 0
    # (time, workers the scale-up sizing asked for): the peaks down_hold_s remembers.
    asked: deque[tuple[float, int]] = field(default_factory=deque)
    settle_until_s: float = -math.inf  # latency before this is not evidence
    last_ready: int | None = None
    # The last cut (time, size after it), and (time, size) of the sizes a pool grew back
    # from soon after a cut to them (see REVERSAL_MEMORY_S).
    last_cut: tuple[float, int] = (-math.inf, 0)
    reversed: deque[tuple[float, int]] = field(default_factory=deque)
    # When each worker still starting was asked for, oldest first (they get ready in order).
    asked_at: deque[float] = field(default_factory=deque)


def warm_start(profile: CapacityProfile, config: PlannerConfig) -> dict[str, int]:
    """The pools' minimums, or (with `expected_rate_rps`) what that load needs, with room in
    the decode KV for its fluctuation (`WARM_KV_SIGMAS`), and the workers of each pool an
    expected burst (`expected_peak_prompt_tokens_1s`) needs: the sizes every adaptive policy
    starts from (the first workers asked for serve a start-up later)."""
    c = config
    sizes = {PREFILL_POOL: c.min_prefill, DECODE_POOL: c.min_decode}
    if c.expected_rate_rps:
        wl = Workload(
            c.expected_rate_rps,
            LengthDist.exponential(c.prior_prompt_tokens),
            LengthDist.exponential(c.prior_output_tokens),
        )
        targets = Targets(
            c.slo_ttft_s,
            c.slo_tpot_s,
            c.headroom,
            c.disagg_threshold,
            c.arrival_scv,
            c.tpot_tail_share,
            ttft_per_1k_s=c.slo_ttft_ms_per_1k / 1000.0,
            kv_sigmas=WARM_KV_SIGMAS,
        )
        bounds = Bounds(c.min_prefill, c.max_prefill, c.min_decode, c.max_decode)
        plan = plan_pools(profile, wl, targets, Corrections(), bounds)
        sizes = {PREFILL_POOL: plan.prefill.workers, DECODE_POOL: plan.decode.workers}
        peak = c.expected_peak_prompt_tokens_1s
        if peak and c.burst_half_life_s > 0 and not plan.local_only:
            held = burst_holds(profile, peak, wl, targets, Corrections(), bounds)
            for pool, n in zip((PREFILL_POOL, DECODE_POOL), held, strict=True):
                sizes[pool] = max(sizes[pool], n)
    floors = {PREFILL_POOL: c.min_prefill, DECODE_POOL: c.min_decode}
    gpus = c.pool_gpus(profile.gpus_per_worker)
    return fit_budget(sizes, sizes, c.budget_gpus(gpus), {}, floors, gpus)


class Planner:
    """The planner policy (see the module doc); deterministic, no I/O, no clock of its own."""

    name = "planner"

    def __init__(self, profile: CapacityProfile, config: PlannerConfig) -> None:
        self.profile, self.config = profile, config
        self.startup_s = config.resolved_startup_s(profile.startup_s)
        self.gpus = config.pool_gpus(profile.gpus_per_worker)  # pool -> GPUs per worker
        self.budget = config.budget_gpus(self.gpus)
        self.targets = Targets(
            config.slo_ttft_s,
            config.slo_tpot_s,
            config.headroom,
            config.disagg_threshold,
            config.arrival_scv,
            config.tpot_tail_share,
            ttft_per_1k_s=config.slo_ttft_ms_per_1k / 1000.0,
            backlog_drain_s=config.interval_s,
        )
        self.bounds = Bounds(
            config.min_prefill, config.max_prefill, config.min_decode, config.max_decode
        )
        self.demand = DemandTracker(config, self.startup_s)
        self.corrections = {PREFILL_POOL: 1.0, DECODE_POOL: 1.0}
        self.state = {pool: PoolState() for pool in POOLS}

    # -- the Policy interface ----------------------------------------------------------------
    def initial(self) -> dict[str, int]:
        """The pools' minimums, or (with `expected_rate_rps`) what the expected load needs."""
        return warm_start(self.profile, self.config)

    def decide(self, now: float, window: WindowSignals, pools: PoolCounts) -> Decision:
        if not self.demand.windows:  # the first decision: the initial sizes took effect at
            for st in self.state.values():  # the window's start and count as a change, so
                st.last_change_s = max(st.last_change_s, window.start_s)  # a warm start is
        self.demand.observe(window)  # not undone by the first quiet seconds of traffic
        self._note_ready_changes(now, pools)
        self._correct(now, window, pools)
        corr = Corrections(self.corrections[PREFILL_POOL], self.corrections[DECODE_POOL])
        have = {pool: pools.provisioned(pool) for pool in POOLS}
        prefer_local = have[PREFILL_POOL] == 0
        queued_wl = self.demand.workload(self.demand.up_rate())
        up_wl, plans, down = self._rate_plans(now, queued_wl, pools, corr, prefer_local)
        up = plans[DECODE_POOL]
        # Any queue holds a pool's size, even one its workers will drain before a new one.
        queued = prefill_load(self.profile, queued_wl, self.targets, corr.prefill)
        backlog = {
            PREFILL_POOL: bool(not up.local_only and queued and queued.backlog_tokens > 0),
            DECODE_POOL: window.decode_waiting > 0,
        }
        # The burst hold has the rates' hysteresis: a pool shrinks below it only with
        # down_margin to spare (1-s peaks are heavy-tailed: a hold that had just decayed
        # under a size was pushed back over it by the next window's peak, ServeGen 10:00).
        held = {PREFILL_POOL: 0, DECODE_POOL: 0}
        held_down = dict(held)
        if not up.local_only:
            margin = 1 + self.config.down_margin
            held[PREFILL_POOL], held[DECODE_POOL] = self._burst_holds(corr, queued_wl)
            both = self._burst_holds(corr, queued_wl, margin)
            held_down[PREFILL_POOL], held_down[DECODE_POOL] = both
        desired, causes, reasons = {}, {}, {}
        for pool in POOLS:
            need_up = max(_workers(plans[pool], pool), held[pool])
            need_down = max(_workers(down[pool], pool), held_down[pool])
            desired[pool], causes[pool], reasons[pool] = self._step(
                pool, now, need_up, need_down, have[pool], backlog[pool], plans[pool]
            )
            if held[pool] and held[pool] >= desired[pool] > _workers(plans[pool], pool):
                what = "" if pool == PREFILL_POOL else " for their answers in flight at once"
                reasons[pool] += (
                    f"; burst hold: {tokens(self.demand.held_peak_tokens_1s)} prompt tokens "
                    f"within 1 s (recent peak, decaying) need {held[pool]} workers{what}"
                )
        self._fit_budget(desired, causes, reasons, have, pools, up_wl, corr)
        for pool in POOLS:
            self._record(pool, now, desired[pool], have[pool])
        predicted = self._predicted(up_wl, up, desired, corr)
        return Decision(desired, reasons, causes, predicted)

    # -- sizing ------------------------------------------------------------------------------
    def _rate_plans(
        self,
        now: float,
        queued_wl: Workload,
        pools: PoolCounts,
        corr: Corrections,
        prefer_local: bool,
    ) -> tuple[Workload, dict[str, PoolPlan], dict[str, PoolPlan]]:
        """(the scale-up workload, the up plan per pool, the down plan per pool). The prefill
        pool is sized at the rate averaged over its queue room (`_queue_room_s`: a loose TTFT
        target lets a burst queue and drain), the decode pool at the window's own rate (a
        sequence waiting for a slot stretches its TPOT; tried: room from the TPOT slack of the
        short answers, which saved 1% on the Mooncake slice and smoothed bursts that a 50 ms
        target needs met at once). The prefill pool's margins also cover the rate forecast's
        measured error over a start-up (`DemandTracker.horizon_error`): on a conversation
        trace's ramps it kept a worker that a 30% rise within a minute needed (2,500 TTFT
        misses at 3 workers). The decode pool keeps the noise margin: there the learned one
        added decode workers and turns on the Mooncake and conversation traces for no
        attainment (benchmarks/README.md, "A margin from the forecast's own error")."""
        rooms = {PREFILL_POOL: self._queue_room_s(queued_wl, corr), DECODE_POOL: 0.0}
        self.demand.level_share = queue_share(self.config.interval_s, rooms[PREFILL_POOL])
        # How long a window's excess keeps each pool busy: a prefill spike queues and drains
        # (or misses) within its room; a decode spike's sequences hold their slots for their
        # answers' length at the TPOT target.
        spikes = {
            PREFILL_POOL: rooms[PREFILL_POOL],
            DECODE_POOL: queued_wl.outputs.mean() * self.targets.slo_tpot_s,
        }
        up, down = {}, {}
        for pool, room_s in rooms.items():
            share = queue_share(self.config.interval_s, room_s)
            targets = replace(self.targets, queue_share=share)
            learned = pool == PREFILL_POOL  # see the method's doc
            rate = self.demand.up_rate(room_s, spikes[pool], learned)
            wl = self._residual_backlog(now, self.demand.workload(rate), pools, corr)
            up[pool] = self._plan(wl, corr, prefer_local, targets)
            # A window's answers are counted when they finish: a heavier answer mix is work
            # that has left the decode pool, and the sequences still running are what fills
            # it. So the decode pool takes it only where a spike outlives a start-up, like a
            # rate spike (a lasting shift reaches the history within history_s). A prompt mix
            # is counted on arrival: its work is still to come, and on the conversation
            # traces a window of long prompts was followed by more. A window that may queue
            # for more than a window is met by the queue room (its rate share above).
            outlives = pool == PREFILL_POOL or self.demand.spike_outlives_startup(spikes[pool])
            burst_wl = self.demand.burst_workload(rate) if outlives else None
            if burst_wl is not None and (pool == DECODE_POOL or share > 0.5):
                burst = self._plan(burst_wl, corr, prefer_local, targets)
                if _workers(burst, pool) > _workers(up[pool], pool):
                    up[pool] = burst
            down_wl = self.demand.workload(self.demand.down_rate(room_s, learned))
            down[pool] = self._plan(down_wl, corr, prefer_local, targets)
            if pool == DECODE_POOL:
                up_wl = wl
        return up_wl, up, down

    def _queue_room_s(self, wl: Workload, corr: Corrections) -> float:
        """Seconds a prompt may wait in a prefill queue within the TTFT target: the goal less
        the request overhead and the p90 prompt's own prefill (0 for a tight target)."""
        p90 = wl.prompts.quantile(0.9) * wl.uncached
        own = corr.prefill * self.profile.prefill_s(p90)
        goal = self.targets.ttft_goal_for(p90)
        return max(0.0, goal - self.profile.request_overhead_s - own)

    def _plan(
        self,
        wl: Workload,
        corr: Corrections,
        prefer_local: bool,
        targets: Targets | None = None,
    ) -> PoolPlan:
        targets = targets or self.targets
        return plan_pools(self.profile, wl, targets, corr, self.bounds, prefer_local)

    def _burst_holds(self, corr: Corrections, wl: Workload, scale: float = 1.0) -> tuple[int, int]:
        """(prefill, decode) workers the held 1-s burst peak (times `scale`) needs."""
        peak = self.demand.held_peak_tokens_1s * scale
        return burst_holds(self.profile, peak, wl, self.targets, corr, self.bounds)

    def _residual_backlog(
        self, now: float, wl: Workload, pools: PoolCounts, corr: Corrections
    ) -> Workload:
        """`wl` with only the queues a worker asked for now would still find (backlog.py)."""
        serving = {}
        for pool in POOLS:
            asked = self.state[pool].asked_at
            while len(asked) > pools.starting.get(pool, 0):
                asked.popleft()  # the oldest got ready (or a cut took them)
            serving[pool] = serving_until_ready(
                pools.ready.get(pool, 0), asked, now, self.startup_s
            )
        wl = residual_prefill(self.profile, wl, serving[PREFILL_POOL], corr, self.startup_s)
        return residual_decode(
            self.profile, self.targets, wl, serving[DECODE_POOL], corr, self.startup_s
        )

    def _bounds_of(self, pool: str) -> tuple[int, int]:
        b = self.bounds
        if pool == PREFILL_POOL:
            return b.min_prefill, b.max_prefill
        return b.min_decode, b.max_decode

    # -- hysteresis --------------------------------------------------------------------------
    def _step(
        self,
        pool: str,
        now: float,
        need_up: int,
        need_down: int,
        have: int,
        backlog: bool,
        plan: PoolPlan,
    ) -> tuple[int, str, str]:
        """(desired, cause, reason) of one pool before the budget."""
        c, st = self.config, self.state[pool]
        lo, hi = self._bounds_of(pool)
        need_down = max(need_down, self._down_floor(pool, now, need_up))
        if have < lo or have > hi:
            n = min(max(have, lo), hi)
            return n, "bounds", f"bounds: {have} -> {n} workers (min {lo}, max {hi})"
        if need_up > have:
            st.down_streak = 0
            wait = st.last_change_s + c.up_cooldown_s - now
            if wait > 0:
                return have, "cooldown", f"cooldown: wants {need_up}, {wait:.0f} s to go"
            cause, why = explain(pool, plan, self.targets)
            factor = self.corrections[pool]
            if cause == "demand" and factor > LATENCY_FACTOR:
                cause, why = "latency", f"{why} (capacity / {factor:.2f}: observed latency)"
            return need_up, cause, f"up: {have} -> {need_up}: {why}"
        if need_down >= have:
            st.down_streak = 0
            _, why = explain(pool, plan, self.targets)
            if any(n == have - 1 for _, n in st.reversed):
                why += (
                    f"; not {have - 1} again: the pool grew back from it within "
                    f"{REVERSAL_MEMORY_S / 60:.0f} minutes"
                )
            return have, "steady", f"steady at {have} (fewer only with margin to spare): {why}"
        st.down_streak += 1
        if backlog:
            return have, "backlog", f"holding {have}: a backlog is queued (wants {need_down})"
        wait = st.last_change_s + c.down_cooldown_s - now
        if st.down_streak < c.down_stable_windows or wait > 0:
            return (
                have,
                "cooldown",
                (
                    f"cooldown: wants {need_down} for {min(st.down_streak, c.down_stable_windows)}"
                    f"/{c.down_stable_windows} windows, {max(wait, 0):.0f} s of down cooldown left"
                ),
            )
        step = max(c.down_step, math.floor(c.down_fraction * have))
        n = have - min(step, have - need_down)
        return (
            n,
            "idle",
            (
                f"down: {have} -> {n}: {need_down} would carry the forecast with margin "
                f"for {st.down_streak} windows"
            ),
        )

    def _down_floor(self, pool: str, now: float, need_up: int) -> int:
        """The fewest workers a scale-down may leave: the peaks the scale-up sizing asked for
        in the last down_hold_s, and one more than a size the pool grew back from within
        REVERSAL_MEMORY_S of a cut to it (decode only; see the constant)."""
        st = self.state[pool]
        st.asked.append((now, need_up))
        while st.asked and st.asked[0][0] < now - self.config.down_hold_s:
            st.asked.popleft()
        while st.reversed and st.reversed[0][0] < now - REVERSAL_MEMORY_S:
            st.reversed.popleft()
        return max([*(n for _, n in st.asked), *(n + 1 for _, n in st.reversed)])

    def _fit_budget(
        self,
        desired: dict[str, int],
        causes: dict[str, str],
        reasons: dict[str, str],
        have: dict[str, int],
        pools: PoolCounts,
        wl: Workload,
        corr: Corrections,
    ) -> None:
        if self.budget is None:
            return
        g = self.gpus
        draining = sum(pools.draining.get(pool, 0) * g[pool] for pool in POOLS)
        floors = self._floors()
        cap = max(self.budget - draining, sum(floors[p] * g[p] for p in POOLS))
        if sum(desired[p] * g[p] for p in POOLS) <= cap:
            return
        urgency = self._urgency(have, wl, corr)
        fitted = fit_budget(desired, have, cap, urgency, floors, g)
        for pool in POOLS:
            if fitted[pool] < desired[pool]:
                reasons[pool] = (
                    f"budget: {self.config.gpu_budget} GPUs ({draining} draining) allow "
                    f"{fitted[pool]} of the {desired[pool]} wanted; {reasons[pool]}"
                )
                causes[pool] = "budget"
            desired[pool] = fitted[pool]

    def _floors(self) -> dict[str, int]:
        return {PREFILL_POOL: self.bounds.min_prefill, DECODE_POOL: self.bounds.min_decode}

    def _urgency(self, have: dict[str, int], wl: Workload, corr: Corrections) -> dict[str, float]:
        """How far each pool's SLO is off at its current size (predicted / target)."""
        share, _, local = wl.prompts.split(self.targets.disagg_threshold)
        pload = prefill_load(self.profile, wl, self.targets, corr.prefill)
        ttft = prefill_ttft_p90(self.profile, pload, have[PREFILL_POOL], self.targets)
        dload = decode_load(self.profile, wl, self.targets, corr, local, 1 - share)
        tpot = decode_tpot_p50(self.profile, dload, have[DECODE_POOL])
        return {
            PREFILL_POOL: ttft / self.targets.slo_ttft_s if pload else 0.0,
            DECODE_POOL: tpot / self.targets.slo_tpot_s,
        }

    def _record(self, pool: str, now: float, desired: int, have: int) -> None:
        st = self.state[pool]
        if desired == have:
            return
        st.last_change_s, st.down_streak = now, 0
        if desired > have:
            st.asked_at.extend([now] * (desired - have))
        for _ in range(min(have - desired, len(st.asked_at))):
            st.asked_at.pop()  # a cut stops the newest start-ups first
        cut_at, cut_to = st.last_cut
        if desired < have:
            st.last_cut = (now, desired)
        elif pool == DECODE_POOL and now - cut_at <= REVERSAL_MEMORY_S and have <= cut_to:
            st.reversed.append((now, have))
        # New workers serve after start-up; a drain moves load for about an interval.
        settle = self.startup_s + self.config.interval_s if desired > have else 0.0
        st.settle_until_s = max(st.settle_until_s, now + settle + 2 * self.config.interval_s)

    def _note_ready_changes(self, now: float, pools: PoolCounts) -> None:
        """A worker that just became ready (or left) makes the next window's latency unfair."""
        for pool in POOLS:
            st, ready = self.state[pool], pools.ready.get(pool, 0)
            if st.last_ready is not None and ready != st.last_ready:
                # Its first windows still report requests that queued before it was ready.
                st.settle_until_s = max(st.settle_until_s, now + 2 * self.config.interval_s)
            st.last_ready = ready

    # -- correction ----------------------------------------------------------------------------
    def _correct(self, now: float, window: WindowSignals, pools: PoolCounts) -> None:
        """Blend this window's evidence into each pool's factor, or relax the factor."""
        c = self.config
        wl = self.demand.last_window_workload() or self.demand.workload(window.arrival_rate)
        targets = self.targets
        evidence: dict[str, float | None] = {PREFILL_POOL: None, DECODE_POOL: None}
        if self._fair(
            PREFILL_POOL, now, pools, window.ttft.count, window
        ) and not self._far_under_loose_target(window.ttft.p90):
            ready = pools.ready.get(PREFILL_POOL, 0)
            evidence[PREFILL_POOL] = solve_prefill(
                self.profile, wl, targets, ready, window.ttft.p90, self.corrections[PREFILL_POOL]
            )
        if self._fair(DECODE_POOL, now, pools, window.tpot.count, window):
            ready = pools.ready.get(DECODE_POOL, 0)
            local_all = pools.ready.get(PREFILL_POOL, 0) == 0
            evidence[DECODE_POOL] = solve_decode(
                self.profile,
                wl,
                targets,
                self.corrections[PREFILL_POOL],
                ready,
                local_all,
                window.tpot.p50,
            )
        for pool, target in evidence.items():
            old = self.corrections[pool]
            if target is None:
                self.corrections[pool] = relax(old, c.correction_decay)
            else:
                floor = PREFILL_FLOOR if pool == PREFILL_POOL else CORRECTION_RANGE[0]
                self.corrections[pool] = blend(old, target, c.correction_alpha, floor)

    def _far_under_loose_target(self, ttft_p90_s: float) -> bool:
        wl = self.demand.workload(self.demand.forecast_rate())
        room = self._queue_room_s(wl, Corrections(self.corrections[PREFILL_POOL]))
        loose = queue_share(self.config.interval_s, room) < 0.5
        return loose and ttft_p90_s < EVIDENCE_TTFT_SHARE * self.targets.ttft_goal

    def _fair(
        self, pool: str, now: float, pools: PoolCounts, samples: int, window: WindowSignals
    ) -> bool:
        """Whether the window's latency of `pool` says something about its workers' speed:
        enough samples, every worker settled (none starting, draining or just changed), no
        queue the backlog term already explains, and (prefill) first tokens of requests the
        window's own arrivals account for: the window after traffic stops holds the last
        second's TTFTs at a rate near 0, which read as a 1.5x slower pool (syn-flat's last
        decision started a fifth prefill worker)."""
        if samples < self.config.correction_min_samples or not math.isfinite(
            window.ttft.p90 if pool == PREFILL_POOL else window.tpot.p50
        ):
            return False
        if (
            pools.ready.get(pool, 0) < 1
            or pools.starting.get(pool, 0)
            or pools.draining.get(pool, 0)
        ):
            return False
        if now < self.state[pool].settle_until_s:
            return False
        if pool == DECODE_POOL:
            return window.decode_waiting == 0
        if window.arrivals * ARRIVALS_PER_SAMPLE < samples:
            return False  # latencies of an earlier load (traffic stopped): not this window's
        if window.arrivals and window.local_prefills / window.arrivals > MAX_LOCAL_SHARE:
            return False
        wl = self.demand.workload(window.arrival_rate)
        load = prefill_load(self.profile, wl, self.targets)
        return load is not None and load.backlog_tokens == 0

    # -- reports -------------------------------------------------------------------------------
    def _predicted(
        self, wl: Workload, plan: PoolPlan, desired: dict[str, int], corr: Corrections
    ) -> dict[str, float]:
        """What the planner expects at the desired sizes (non-finite values left out: an
        overloaded pool's latency has no number)."""
        share, _, local = wl.prompts.split(self.targets.disagg_threshold)
        p = desired[PREFILL_POOL]
        if p == 0:
            local, share = wl.prompts, 0.0
        pload = prefill_load(self.profile, wl, self.targets, corr.prefill) if p else None
        dload = decode_load(self.profile, wl, self.targets, corr, local, 1 - share)
        ttfts = [local_ttft_p90(self.profile, dload, desired[DECODE_POOL], self.targets)]
        if pload is not None:
            ttfts.append(prefill_ttft_p90(self.profile, pload, p, self.targets))
        out = {
            "arrival_rate": wl.rate,
            "forecast_rate": self.demand.forecast_rate(),
            "prefill_tokens_per_s": pload.tokens_per_s if pload else 0.0,
            "decode_tokens_per_s": dload.tokens_per_s,
            "ttft_p90_s": max(ttfts),
            "tpot_p50_s": decode_tpot_p50(self.profile, dload, desired[DECODE_POOL]),
            "prefill_correction": corr.prefill,
            "decode_correction": corr.decode,
        }
        return {k: float(v) for k, v in out.items() if math.isfinite(v)}


def _workers(plan: PoolPlan, pool: str) -> int:
    return plan.prefill.workers if pool == PREFILL_POOL else plan.decode.workers
