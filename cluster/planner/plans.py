"""Both pools at once: a `PoolPlan` (a prefill plan and a decode plan) and conditional
disaggregation (`plan_pools`: a prefill pool and a decode pool, or, with `min_prefill` 0, the
decode pool alone prefilling every prompt, whichever needs fewer workers and meets both
targets), and `fit_budget` (both pools' sizes cut to a GPU budget). Each pool's own math is
in sizing.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.capacity_profile import CapacityProfile

from .demand import Workload
from .sizing import (
    Corrections,
    DecodePlan,
    PrefillPlan,
    Targets,
    burst_decode_rate,
    burst_prefill_workers,
    decode_load,
    mix_service,
    prefill_load,
    size_decode,
    size_prefill,
)


@dataclass(slots=True)
class PoolPlan:
    prefill: PrefillPlan
    decode: DecodePlan
    local_only: bool  # no prefill pool: every prompt prefilled on decode workers

    @property
    def workers(self) -> int:
        return self.prefill.workers + self.decode.workers

    @property
    def met(self) -> bool:
        return self.prefill.met and self.decode.met

    @property
    def ttft_p90_s(self) -> float:
        if self.local_only or self.prefill.load is None:
            return self.decode.local_ttft_p90_s
        if self.decode.load.local_rate > 0:
            return max(self.prefill.ttft_p90_s, self.decode.local_ttft_p90_s)
        return self.prefill.ttft_p90_s


@dataclass(slots=True, frozen=True)
class Bounds:
    min_prefill: int
    max_prefill: int
    min_decode: int
    max_decode: int


def plan_disaggregated(
    profile: CapacityProfile, wl: Workload, targets: Targets, corr: Corrections, bounds: Bounds
) -> PoolPlan:
    """A prefill pool for prompts at or above the threshold, the rest prefilled on decode."""
    share, _, local = wl.prompts.split(targets.disagg_threshold)
    load = prefill_load(profile, wl, targets, corr.prefill)
    lo = max(bounds.min_prefill, 1)
    prefill = size_prefill(profile, load, targets, lo, bounds.max_prefill)
    dload = decode_load(profile, wl, targets, corr, local, 1.0 - share)
    decode = size_decode(profile, dload, targets, bounds.min_decode, bounds.max_decode)
    return PoolPlan(prefill, decode, local_only=False)


def burst_holds(
    profile: CapacityProfile,
    peak_tokens_1s: float,
    wl: Workload,
    targets: Targets,
    corr: Corrections,
    bounds: Bounds,
) -> tuple[int, int]:
    """(prefill, decode) workers a 1-s burst of `peak_tokens_1s` uncached prompt tokens needs,
    within the bounds: prefill to clear it (`sizing.burst_prefill_workers` at one worker's
    rate on the mix), decode for its sequences at once (`sizing.burst_decode_rate`, on `wl`'s
    mix without its queues: those are the rate plans' to size)."""
    mu = mix_service(profile, wl.prompts, wl.uncached, corr.prefill)[0]
    prefill = burst_prefill_workers(profile, peak_tokens_1s, targets, corr.prefill, mu)
    rate = burst_decode_rate(profile, peak_tokens_1s, wl, targets, corr.prefill)
    decode = 0
    if rate > 0:
        burst = Workload(rate, wl.prompts, wl.outputs, uncached=wl.uncached)
        decode = plan_disaggregated(profile, burst, targets, corr, bounds).decode.workers
    return min(prefill, bounds.max_prefill), min(decode, bounds.max_decode)


def plan_local(
    profile: CapacityProfile, wl: Workload, targets: Targets, corr: Corrections, bounds: Bounds
) -> PoolPlan:
    """No prefill pool: every prompt is prefilled on a decode worker (mixed steps)."""
    dload = decode_load(profile, wl, targets, corr, wl.prompts, 1.0)
    decode = size_decode(profile, dload, targets, bounds.min_decode, bounds.max_decode)
    prefill = PrefillPlan(0, "demand", None, 0.0, True, "every prompt prefilled on decode")
    return PoolPlan(prefill, decode, local_only=True)


def plan_pools(
    profile: CapacityProfile,
    wl: Workload,
    targets: Targets,
    corr: Corrections,
    bounds: Bounds,
    prefer_local: bool = False,
) -> PoolPlan:
    """The cheaper of "prefill pool + decode pool" and (when min_prefill is 0) "decode pool
    only", among those meeting both targets; ties go to the current mode (`prefer_local`)."""
    split = plan_disaggregated(profile, wl, targets, corr, bounds)
    if bounds.min_prefill > 0:
        return split
    local = plan_local(profile, wl, targets, corr, bounds)
    if local.met != split.met:
        return local if local.met else split
    if local.workers != split.workers:
        return local if local.workers < split.workers else split
    return local if prefer_local else split


def fit_budget(
    desired: dict[str, int],
    base: dict[str, int],
    cap: int | None,
    urgency: dict[str, float],
    floors: dict[str, int] | None = None,
    gpus: dict[str, int] | None = None,
) -> dict[str, int]:
    """`desired` cut to at most `cap` GPUs in all, a worker of pool p holding `gpus[p]` of
    them (default 1: `cap` counts workers). Each pool keeps its `base` (what it has, or less
    if it wants less); the room above the bases goes to the pools' shortfalls in proportion
    (of GPUs), the last GPUs to the most urgent pool (SLO furthest off) that a whole worker
    of it still fits. No pool goes below its floor (its minimum; the caller's cap holds the
    floors)."""
    g = {p: (gpus or {}).get(p, 1) for p in desired}

    def used(sizes: dict[str, int]) -> int:
        return sum(sizes[p] * g[p] for p in sizes)

    if cap is None or used(desired) <= cap:
        return dict(desired)
    low = floors or {}
    out = {p: min(base[p], desired[p]) for p in desired}
    while used(out) > cap:  # bases over the cap: take from the least urgent
        above = [p for p in out if out[p] > low.get(p, 0)]
        if not above:
            raise ValueError(f"a cap of {cap} GPUs cannot hold the floors {low}")
        pool = min(above, key=lambda p: (urgency.get(p, 0), -out[p]))
        out[pool] -= 1
    room = cap - used(out)
    short = {p: desired[p] - out[p] for p in desired}
    total = sum(short[p] * g[p] for p in desired)
    grant = {p: room * short[p] * g[p] // total // g[p] for p in desired}
    room -= used(grant)
    for p in sorted(desired, key=lambda p: -urgency.get(p, 0)):
        extra = min(room // g[p], short[p] - grant[p])
        grant[p], room = grant[p] + extra, room - extra * g[p]
    return {p: out[p] + grant[p] for p in desired}
