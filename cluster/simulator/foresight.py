"""`ForesightPolicy`: a bound on what any forecaster could save, for the autoscaling results.

The planner is causal: it sees the windows that have passed and must ask for a worker a
start-up before it serves. This policy reads the trace itself. At every decision it sizes the
prefill pool for the highest prompt-token rate (a rolling mean over `smooth_s`) that will
arrive between now and the time a worker asked for now would be ready (`startup_s +
interval_s`): the fewest workers that meet every second of demand a start-up ahead, at
`utilisation` of one worker's throughput on the trace's prompt mix. A pool that shrinks now
cannot grow back before that horizon, so nothing smaller is safe even with perfect foresight.
The decode pool stays at `decode` workers (the best static split's: the Azure traces' decode
load moves little within the hour). It is a hindsight baseline, like the best static split;
it is not a policy one can run, and the live system has no such thing.

Lifecycle: built once per run from the requests; `initial()` and `decide()` are then pure
lookups (`make_policy` does not build it: it needs the trace).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from bench.capacity_profile import CapacityProfile
from cluster.planner.demand import LengthDist
from cluster.planner.sizing import mix_service
from cluster.planner.types import DECODE_POOL, PREFILL_POOL, Decision, PoolCounts
from cluster.simulator.traces import SimRequest
from router.signals import LengthHistogram, WindowSignals


class ForesightPolicy:
    name = "foresight"

    def __init__(
        self,
        requests: Sequence[SimRequest],
        profile: CapacityProfile,
        *,
        decode: int,
        horizon_s: float,
        utilisation: float = 0.9,
        smooth_s: int = 5,
        max_prefill: int | None = None,
    ) -> None:
        if not requests:
            raise ValueError("foresight needs the trace's requests")
        if decode < 1 or horizon_s <= 0 or not 0 < utilisation <= 1 or smooth_s < 1:
            raise ValueError(
                f"foresight needs decode >= 1, horizon_s > 0, utilisation in (0, 1] and "
                f"smooth_s >= 1: {decode}, {horizon_s}, {utilisation}, {smooth_s}"
            )
        lengths = LengthHistogram()
        for r in requests:
            lengths.add(r.prompt_len)
        prompts = LengthDist.of(lengths)
        assert prompts is not None  # requests is not empty
        self.mu = mix_service(profile, prompts)[0]
        self.rate = rolling_token_rate(requests, smooth_s)
        self.decode, self.horizon_s = decode, horizon_s
        self.utilisation, self.max_prefill = utilisation, max_prefill

    def workers_for(self, start_s: float, end_s: float) -> int:
        """Prefill workers the highest smoothed prompt-token rate in [start_s, end_s] needs."""
        lo, hi = max(int(start_s), 0), min(int(end_s) + 1, len(self.rate))
        peak = max(self.rate[lo:hi], default=0.0)
        n = max(1, math.ceil(peak / (self.mu * self.utilisation) - 1e-9))
        return n if self.max_prefill is None else min(n, self.max_prefill)

    def initial(self) -> dict[str, int]:
        return {PREFILL_POOL: self.workers_for(0.0, self.horizon_s), DECODE_POOL: self.decode}

    def decide(self, now: float, window: WindowSignals, pools: PoolCounts) -> Decision:
        n = self.workers_for(now, now + self.horizon_s)
        why = (
            f"foresight: the next {self.horizon_s:.0f} s peak at {self.utilisation:.0%} of "
            f"{self.mu / 1e3:.1f}k tok/s per worker needs {n}"
        )
        return Decision(
            {PREFILL_POOL: n, DECODE_POOL: self.decode},
            reasons={PREFILL_POOL: why, DECODE_POOL: f"fixed at {self.decode}"},
            causes={PREFILL_POOL: "demand", DECODE_POOL: "static"},
        )


def rolling_token_rate(requests: Sequence[SimRequest], smooth_s: int) -> list[float]:
    """Per second of the trace: prompt tokens/s arriving over the `smooth_s` seconds that end
    with it."""
    per_second = [0.0] * (int(requests[-1].arrival_s) + 2)
    for r in requests:
        per_second[int(r.arrival_s)] += r.prompt_len
    out, window = [], 0.0
    for i, tokens in enumerate(per_second):
        window += tokens - (per_second[i - smooth_s] if i >= smooth_s else 0.0)
        out.append(window / smooth_s)
    return out
