"""The queues a worker asked for now would still find when it is ready.

A worker asked for now serves `startup_s` later. A queue the pool drains before then is no
reason to start one: a worker started for a backlog that is gone when it serves is a
start-up's worth of GPU time for nothing, and one the down margin then keeps for minutes.
The pool that drains it is the workers ready now, and each worker still starting for the
share of that start-up it will already serve (`serving_until_ready`): on a 2.5x step the
prefill pool grew 13 -> 15 -> 17 and the decode pool 4 -> 12 for queues that the workers
asked for a window or two earlier had drained by the time the last ones served
(benchmarks/README.md, "a rise re-levelled at once, queues net of the workers starting").

Pure functions; the planner (policy.py) keeps when it asked for each worker.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

from bench.capacity_profile import CapacityProfile

from .demand import Workload
from .sizing import Corrections, Targets, decode_batch, decode_load, mix_service


def serving_until_ready(
    ready: int, asked_at: Iterable[float], now: float, startup_s: float
) -> float:
    """Workers serving, on average, between now and when a worker asked for now is ready:
    the `ready` ones, and each still starting (asked for at a time in `asked_at`) for the
    share of that start-up it will already serve, (now - asked) / startup_s."""
    ahead = sum(min(1.0, max(0.0, (now - t) / startup_s)) for t in asked_at) if startup_s else 0
    return ready + ahead


def residual_prefill(
    profile: CapacityProfile,
    wl: Workload,
    serving: float,
    corr: Corrections,
    startup_s: float,
) -> Workload:
    """`wl` with only the queued prompt tokens that `serving` prefill workers, computing
    the arriving prompts too, will not have drained within `startup_s`."""
    if serving <= 0 or wl.queued_prompt_tokens <= 0:
        return wl
    mu = mix_service(profile, wl.prompts, wl.uncached, corr.prefill)[0]
    arriving = wl.rate * wl.prompts.mean() * wl.uncached
    drained = max(0.0, serving * mu - arriving) * startup_s
    left = max(0.0, wl.queued_prompt_tokens - drained)
    share = left / wl.queued_prompt_tokens
    return replace(
        wl, queued_prompt_tokens=left, prefill_waiting=math.ceil(wl.prefill_waiting * share)
    )


def residual_decode(
    profile: CapacityProfile,
    targets: Targets,
    wl: Workload,
    serving: float,
    corr: Corrections,
    startup_s: float,
) -> Workload:
    """`wl` with only the sequences waiting for a decode slot that `serving` workers will
    not have admitted within `startup_s`: a slot frees each time a sequence finishes, at
    most the batch the step goal allows per worker, a sequence living as long as its
    answer takes at the TPOT target (the slow end: fewer admitted), less the slots the
    arriving requests take."""
    if serving <= 0 or wl.decode_waiting <= 0:
        return wl
    load = decode_load(profile, wl, targets, corr, None, 0.0)
    batch = max(1, decode_batch(profile, load, 0.0))
    lifetime_s = max(wl.outputs.mean(), 1.0) * targets.slo_tpot_s
    admitted = max(0.0, serving * batch / lifetime_s - wl.rate) * startup_s
    return replace(wl, decode_waiting=max(0, math.ceil(wl.decode_waiting - admitted)))
