"""The planner's interface: what a policy is told each interval and what it answers.

Every policy (the planner itself and the simulator's baselines) is a `Policy`: each interval it
gets the window of signals that just ended and the pools as they stand, and returns a
`Decision` (desired replicas per pool, each with its reason). It never starts or stops anything
itself: the live autoscaler (cluster/autoscaler.py) and the simulator (cluster/simulator/) act
on the decision, so the same policy code runs in both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from router.signals import WindowSignals

PREFILL_POOL, DECODE_POOL, COLOCATED_POOL = "prefill", "decode", "colocated"
POOLS = (PREFILL_POOL, DECODE_POOL, COLOCATED_POOL)
UP, DOWN, HOLD = "up", "down", "hold"
# Why a pool's size was chosen (the `reason` label of tandem_planner_decisions_total):
# the demand forecast, the queued backlog, observed latency over the target, load under
# what the pool needs, a min/max bound, the GPU budget, a cooldown holding a change back,
# a fixed size (static baselines), or nothing to change.
CAUSES = (
    "demand", "backlog", "latency", "idle", "bounds", "budget", "cooldown", "static", "steady",
)  # fmt: skip


@dataclass(slots=True)
class PoolCounts:
    """Workers per pool. `ready` serve now; `starting` were asked for and are not ready yet;
    `draining` are finishing their last requests (they take no new ones)."""

    ready: dict[str, int] = field(default_factory=dict)
    starting: dict[str, int] = field(default_factory=dict)
    draining: dict[str, int] = field(default_factory=dict)

    def provisioned(self, pool: str) -> int:
        """Ready plus starting: what the pool will have once start-ups finish."""
        return self.ready.get(pool, 0) + self.starting.get(pool, 0)


@dataclass(slots=True)
class Decision:
    """Desired replicas per pool (only the pools the policy manages), why (`reasons`: a
    sentence a person reads; `causes`: a short code per pool for metric labels, one of
    CAUSES), and what the policy predicts for the next interval (predicted-vs-observed)."""

    desired: dict[str, int]
    reasons: dict[str, str] = field(default_factory=dict)
    causes: dict[str, str] = field(default_factory=dict)
    predicted: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for pool, n in self.desired.items():
            if pool not in POOLS:
                raise ValueError(f"unknown pool {pool!r}; pools are {POOLS}")
            if n < 0:
                raise ValueError(f"desired replicas of {pool} must be >= 0, got {n}")
        for pool, cause in self.causes.items():
            if cause not in CAUSES:
                raise ValueError(f"cause of {pool} must be one of {CAUSES}, got {cause!r}")

    def direction(self, pool: str, current: int) -> str:
        n = self.desired.get(pool, current)
        return UP if n > current else DOWN if n < current else HOLD


class Policy(Protocol):
    """Anything that sizes the pools. `now` is seconds on the caller's clock (wall time live,
    simulated time in the simulator); policies keep their own state (cooldowns, history)."""

    name: str

    def initial(self) -> dict[str, int]:
        """Replicas per pool to start with, before any traffic is seen."""
        ...

    def decide(self, now: float, window: WindowSignals, pools: PoolCounts) -> Decision: ...
