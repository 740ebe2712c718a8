"""The hindsight baselines: the static split (P prefill, D decode workers) or the colocated
replica count with the fewest GPU-hours that still reaches a target SLO attainment on the
whole trace, found by simulating it.

Search: for a fixed P, more decode workers never hurt, so the least D that reaches the
target is found by bisection; and a P with more prefill workers needs no more decode workers
than a smaller P did, so each P's bisection is bounded by the previous P's answer. A P whose
smallest total (P + the least D allowed) already has more workers than the best split found
is skipped: a static split's GPU-hours are its worker count times the run's length, and the
length barely moves. Every probe stops as soon as more requests have missed the SLO than the
target allows (`abort_after_misses`), so infeasible splits cost little. Colocated: bisection
on the replica count.

Lifecycle: `best_static(...)` / `best_colocated(...)` -> `SweepResult` (every probe as a
`SweepPoint`, the best one and its full `SimResult`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from bench.capacity_profile import CapacityProfile
from cluster.planner import make_policy
from cluster.planner.config import PlannerConfig
from cluster.planner.types import DECODE_POOL, PREFILL_POOL, Policy
from cluster.simulator.run import SimConfig, SimResult, simulate
from cluster.simulator.traces import SimRequest


@dataclass(slots=True)
class SweepPoint:
    """One probe: `prefill` is 0 for a colocated probe (its `replicas` in `decode`)."""

    prefill: int
    decode: int
    attainment: float
    gpu_hours: float
    meets: bool
    aborted: str | None = None
    wall_s: float = 0.0

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(slots=True)
class SweepResult:
    kind: str  # "static" or "colocated"
    target: float
    points: list[SweepPoint] = field(default_factory=list)
    best: SweepPoint | None = None
    best_result: SimResult | None = None

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "target_attainment": self.target,
            "best": None if self.best is None else self.best.to_dict(),
            "points": [p.to_dict() for p in self.points],
        }


class _Prober:
    """Runs probes, remembers them, and keeps the cheapest one that meets the target."""

    def __init__(
        self,
        requests: list[SimRequest],
        profile: CapacityProfile,
        config: SimConfig,
        target: float,
        kind: str,
    ) -> None:
        if not (0 < target <= 1):
            raise ValueError(f"target attainment must be in (0, 1], got {target}")
        self.requests, self.profile = requests, profile
        allowed = math.floor((1 - target) * len(requests) + 1e-9)
        # A probe is hopeless once more requests missed than the target allows.
        self.config = replace(config, abort_after_misses=allowed, progress=False)
        self.sweep = SweepResult(kind, target)
        self._seen: dict[tuple[int, int], SweepPoint] = {}

    def meets(self, prefill: int, decode: int, policy: Callable[[], Policy]) -> bool:
        key = (prefill, decode)
        if key not in self._seen:
            result = simulate(self.requests, self.profile, policy(), self.config)
            ok = result.aborted is None and result.attainment >= self.sweep.target
            point = SweepPoint(
                prefill,
                decode,
                result.attainment,
                result.gpu_hours,
                ok,
                result.aborted,
                result.wall_s,
            )
            self._seen[key] = point
            self.sweep.points.append(point)
            best = self.sweep.best
            if ok and (best is None or point.gpu_hours < best.gpu_hours):
                self.sweep.best, self.sweep.best_result = point, result
        return self._seen[key].meets


def _least(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """The least n in [lo, hi] with ok(n), for ok monotone (False... then True...)."""
    if lo > hi or not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def best_static_for(
    requests: list[SimRequest],
    profile: CapacityProfile,
    config: SimConfig,
    planner: PlannerConfig,
    target: float = 0.99,
) -> SweepResult:
    """`best_static` over the planner's pool bounds and GPU budget, with its static policies."""
    return best_static(
        requests,
        profile,
        config,
        lambda p, d: make_policy(f"static:{p}:{d}", profile, planner),
        prefill_counts=range(planner.min_prefill, planner.max_prefill + 1),
        decode_counts=(planner.min_decode, planner.max_decode),
        target=target,
        gpu_budget=planner.gpu_budget,
    )


def best_static(
    requests: list[SimRequest],
    profile: CapacityProfile,
    config: SimConfig,
    make_policy: Callable[[int, int], Policy],
    *,
    prefill_counts: Sequence[int],
    decode_counts: tuple[int, int],
    target: float = 0.99,
    gpu_budget: int | None = None,
) -> SweepResult:
    """The static split with the fewest GPU-hours reaching `target`: P from `prefill_counts`
    (ascending), D in the inclusive range `decode_counts`, P x prefill GPUs + D x decode GPUs
    (each pool's TP size, `config.pool_gpus`) within `gpu_budget`. `make_policy(P, D)`
    builds the static policy."""
    prober = _Prober(requests, profile, config, target, "static")
    d_lo, d_hi = decode_counts
    g = config.pool_gpus(profile.gpus_per_worker)
    gp, gd = g[PREFILL_POOL], g[DECODE_POOL]
    for p in sorted(prefill_counts):
        best = prober.sweep.best
        if best is not None and p * gp + d_lo * gd > best.prefill * gp + best.decode * gd:
            break  # every later P holds more GPUs than the best split
        top = d_hi if gpu_budget is None else min(d_hi, (gpu_budget - p * gp) // gd)
        least = _least(d_lo, top, lambda d, p=p: prober.meets(p, d, lambda: make_policy(p, d)))
        if least is not None:
            d_hi = least  # more prefill workers never need more decode workers
    return prober.sweep


def best_colocated(
    requests: list[SimRequest],
    profile: CapacityProfile,
    config: SimConfig,
    make_policy: Callable[[int], Policy],
    *,
    replica_counts: tuple[int, int],
    target: float = 0.99,
    gpu_budget: int | None = None,
) -> SweepResult:
    """The fewest colocated replicas in the inclusive range `replica_counts` (within the GPU
    budget) reaching `target`."""
    prober = _Prober(requests, profile, config, target, "colocated")
    lo, hi = replica_counts
    if gpu_budget is not None:
        hi = min(hi, gpu_budget // profile.gpus_per_worker)
    _least(lo, hi, lambda k: prober.meets(0, k, lambda: make_policy(k)))
    return prober.sweep
