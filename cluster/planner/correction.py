"""Correction factors: how much slower (> 1) or faster (< 1) than the profile a pool runs.

Pure functions; the planner (policy.py) decides which windows are evidence and keeps the
factors. A factor scales the time of a step (prefill or decode), so it scales each worker's
capacity by its inverse. It is solved in capacity space, not taken as observed / predicted
latency: latency is steeply non-linear in load near saturation, and a latency ratio of 2 from
a queue (Dynamo's correction after a slow start) would halve the assumed capacity. Solving for
the factor that makes the model predict what was observed keeps a queue's spike from reading as
a slow GPU. `blend` then moves the factor a bounded step toward it (EWMA, clamped per step and
overall); `relax` decays it toward 1 when a window brings no evidence.

A TTFT p90 is evidence of prefill capacity only where capacity sets it: where the model
predicts a queue at least as long as the p90 prompt's own time (`prefill_queue_matters`), or
where the p90 nears the goal. Far under the goal with no queue predicted, the p90 is the
prompt's own step plus the clumps in which bursty clients arrive (ServeGen's Model Studio
traffic: p90 2-8x the model's at 30% utilisation, p50 within 1.2x); solved as capacity, such
windows drove the factor 1.2 -> 2.0 and the prefill pool to twice the static split's.
"""

from __future__ import annotations

import math
from dataclasses import replace

from bench.capacity_profile import CapacityProfile

from .demand import Workload
from .sizing import (
    Corrections,
    PrefillLoad,
    Targets,
    decode_load,
    decode_tpot_p50,
    p90_prompt_alone_s,
    prefill_load,
    prefill_ttft_p90,
)

STEP_CLAMP = (0.7, 1.5)  # the most a factor moves in one window (multiplicative)
CORRECTION_RANGE = (0.5, 2.0)
# The prefill factor never goes below 1: a TTFT p90 under the prediction is mostly the tail
# estimate of a window's few long prompts and arrival luck, and reading it as faster workers
# is what turns the next burst into misses (a new worker is a start-up away). TPOT is a
# deterministic function of batch and context, so the decode factor moves both ways.
PREFILL_FLOOR = 1.0
SOLVE_RANGE = (0.25, 4.0)  # capacity factors an observation is solved within
SOLVE_STEPS = 24
# A p90 at this share of the TTFT goal or more is evidence however the model explains it.
NEAR_GOAL = 0.5


def blend(old: float, target: float, alpha: float, floor: float = CORRECTION_RANGE[0]) -> float:
    """One EWMA step of a factor toward `target`, at most STEP_CLAMP per step, within
    CORRECTION_RANGE (and not below `floor`)."""
    new = old + alpha * (target - old)
    new = min(max(new, old * STEP_CLAMP[0]), old * STEP_CLAMP[1])
    return min(max(new, CORRECTION_RANGE[0], floor), CORRECTION_RANGE[1])


def relax(old: float, decay: float) -> float:
    """A factor with no new evidence drifts back toward 1."""
    return 1.0 + (old - 1.0) * (1.0 - decay)


def _solve(predict, observed: float) -> float:
    """The factor in SOLVE_RANGE at which the increasing `predict(factor)` equals `observed`
    (bisection on a log scale; a bound when the observation lies outside)."""
    lo, hi = SOLVE_RANGE
    if predict(lo) >= observed:
        return lo
    if predict(hi) <= observed:
        return hi
    for _ in range(SOLVE_STEPS):
        mid = math.sqrt(lo * hi)
        if predict(mid) < observed:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def prefill_queue_matters(
    profile: CapacityProfile, load: PrefillLoad, ready: int, targets: Targets
) -> bool:
    """Whether the model predicts a TTFT p90 wait at least as long as the p90 prompt's own
    time (request overhead and its step) for `load` on `ready` workers."""
    alone = p90_prompt_alone_s(profile, load)
    return prefill_ttft_p90(profile, load, ready, targets) >= 2 * alone


def solve_prefill(
    profile: CapacityProfile,
    wl: Workload,
    targets: Targets,
    ready: int,
    observed_p90_s: float,
    factor: float = 1.0,
) -> float | None:
    """The prefill factor that explains an observed TTFT p90 with `ready` workers serving
    `wl`. None: the prefill pool had nothing to serve, or the p90 says nothing of capacity
    (under NEAR_GOAL of the goal where the model at the current `factor` predicts no queue
    that matters: see the module doc)."""
    base = prefill_load(profile, wl, targets) if ready >= 1 else None
    if base is None:
        return None
    if observed_p90_s < NEAR_GOAL * targets.ttft_goal and not prefill_queue_matters(
        profile, base.corrected(factor), ready, targets
    ):
        return None

    def predict(factor: float) -> float:
        return prefill_ttft_p90(profile, base.corrected(factor), ready, targets)

    return _solve(predict, observed_p90_s)


def solve_decode(
    profile: CapacityProfile,
    wl: Workload,
    targets: Targets,
    prefill_factor: float,
    ready: int,
    local_all: bool,
    observed_p50_s: float,
) -> float | None:
    """The decode factor that explains an observed TPOT p50 with `ready` workers, at the
    batch seen running (else Little's), local prefills' share of the time included."""
    if ready < 1:
        return None
    if local_all:
        local, share = wl.prompts, 1.0
    else:
        above, _, local = wl.prompts.split(targets.disagg_threshold)
        share = 1.0 - above
    batch = wl.decode_running / ready if wl.decode_running else None
    base = decode_load(profile, wl, targets, Corrections(prefill_factor, 1.0), local, share)

    def predict(factor: float) -> float:
        return decode_tpot_p50(profile, replace(base, decode_corr=factor), ready, batch)

    return _solve(predict, observed_p50_s)
