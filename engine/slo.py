"""Service-level targets and the one rule that judges a request by them.

A request meets its TTFT target when its first token came within `slo_ttft_ms` plus
`slo_ttft_ms_per_1k` per 1k prompt tokens (DistServe and Mooncake judge a long prompt by its
length; 0: one target for every prompt), and its TPOT target when its mean time per output
token after the first is within `slo_tpot_ms` (a one-token answer has no TPOT and cannot miss
it). The router's SLO metrics, `tandem bench serve`'s goodput, the planner's sizing and the
simulator's attainment all judge by this module. It lives in the bottom package only because
imports point down and all four read it; nothing here is about the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# How a served request fared against the targets (the router's `tandem_slo_requests` label).
SLO_RESULTS = ("met", "missed_ttft", "missed_tpot", "missed_both")
# Requests the router took and did not serve, which miss every target: failed after
# admission (a worker error, a timeout) or refused (429 queue full, 503 draining or no
# workers). Client cancellations are neither.
SLO_UNSERVED = ("failed", "refused")


def ttft_target(base: float, per_1k: float, prompt_len: float) -> float:
    """A request's TTFT target, in the unit of `base` and `per_1k` (ms or s): the base plus
    an allowance per 1k prompt tokens."""
    return base + per_1k * prompt_len / 1000.0


def _check_target(name: str, value: float | None, allow_zero: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of ms, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'} ms, got {value!r}")


@dataclass(slots=True, frozen=True)
class SloTargets:
    """The targets a request is judged by; None: that latency is not judged."""

    ttft_ms: float | None = None
    ttft_ms_per_1k: float = 0.0
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        _check_target("slo_ttft_ms", self.ttft_ms)
        _check_target("slo_ttft_ms_per_1k", self.ttft_ms_per_1k, allow_zero=True)
        _check_target("slo_tpot_ms", self.tpot_ms)

    @property
    def judged(self) -> bool:
        """Whether any latency is judged at all."""
        return self.ttft_ms is not None or self.tpot_ms is not None

    def ttft_met(self, prompt_len: int, ttft_s: float) -> bool:
        if self.ttft_ms is None:
            return True
        return ttft_s * 1000.0 <= ttft_target(self.ttft_ms, self.ttft_ms_per_1k, prompt_len)

    def tpot_met(self, tpot_s: float | None) -> bool:
        return self.tpot_ms is None or tpot_s is None or tpot_s * 1000.0 <= self.tpot_ms

    def judge(self, prompt_len: int, ttft_s: float, tpot_s: float | None) -> str:
        """One of SLO_RESULTS for a request served to its end."""
        ttft_ok, tpot_ok = self.ttft_met(prompt_len, ttft_s), self.tpot_met(tpot_s)
        if ttft_ok and tpot_ok:
            return "met"
        if tpot_ok:
            return "missed_ttft"
        return "missed_tpot" if ttft_ok else "missed_both"
