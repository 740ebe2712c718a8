"""The policies the planner is judged against, in the same `Policy` shape (so the simulator and
the live autoscaler run them unchanged). Each is stateless or keeps only what its original keeps.

- `StaticPolicy(prefill, decode)`, `ColocatedPolicy(replicas)`: fixed sizes (the hindsight
  sweep of the simulator runs many of them).
- `DynamoStylePolicy`: NVIDIA Dynamo's SLA planner as published, on the last interval only
  (its "constant" predictor): P = ceil(rate * ISL * min(1, prefill correction) / prefill
  tokens/s of one ISL-long prompt), D = ceil(rate * OSL / decode tokens/s per worker at the
  best batch meeting ITL target / decode correction at context ISL + OSL/2); corrections are
  observed / expected latency, unclamped; applied at once in both directions; min/max, then
  its budget rule (prefill scaled down in proportion, decode gets the rest). No queueing term,
  no start-up forecast, no drain delay. Dynamo reads mean TTFT/ITL; a window carries p50s,
  which stand in for the means.
- `ThresholdPolicy`: a Kubernetes HPA (KEDA-fed) on two metrics: queued prompt tokens per
  prefill worker against what one worker prefills within the TTFT target, and decode load
  max(KV usage / 0.8, sequences per worker / the batch meeting the TPOT target). desired =
  ceil(ready * metric / target), no change within a 10% tolerance, scale-up at most
  max(2x, +4) per decision, scale-down to the largest recommendation of the last 300 s.
"""

from __future__ import annotations

import math
from collections import deque

from bench.capacity_profile import CapacityProfile
from router.signals import WindowSignals

from .config import PlannerConfig
from .plans import fit_budget
from .policy import warm_start
from .types import COLOCATED_POOL, DECODE_POOL, PREFILL_POOL, Decision, PoolCounts

POOLS = (PREFILL_POOL, DECODE_POOL)


class StaticPolicy:
    """A fixed split: `prefill` prefill workers (0: every prompt prefilled on decode) and
    `decode` decode workers."""

    name = "static"

    def __init__(self, prefill: int, decode: int) -> None:
        if prefill < 0 or decode < 1:
            raise ValueError(f"static sizes need prefill >= 0 and decode >= 1: {prefill}:{decode}")
        self.sizes = {PREFILL_POOL: prefill, DECODE_POOL: decode}

    def initial(self) -> dict[str, int]:
        return dict(self.sizes)

    def decide(self, now: float, window: WindowSignals, pools: PoolCounts) -> Decision:
        return _fixed(self.sizes)


class ColocatedPolicy:
    """`replicas` colocated workers (each prefills and decodes its own requests)."""

    name = "colocated"

    def __init__(self, replicas: int) -> None:
        if replicas < 1:
            raise ValueError(f"colocated replicas must be >= 1, got {replicas}")
        self.sizes = {COLOCATED_POOL: replicas}

    def initial(self) -> dict[str, int]:
        return dict(self.sizes)

    def decide(self, now: float, window: WindowSignals, pools: PoolCounts) -> Decision:
        return _fixed(self.sizes)


def _fixed(sizes: dict[str, int]) -> Decision:
    reasons = {pool: f"static: {n} workers" for pool, n in sizes.items()}
    return Decision(dict(sizes), reasons, {pool: "static" for pool in sizes})


class _Bounded:
    """min/max per pool and the GPU budget, shared by the adaptive baselines."""

    def __init__(self, profile: CapacityProfile, config: PlannerConfig) -> None:
        self.profile, self.config = profile, config
        self.gpus = config.pool_gpus(profile.gpus_per_worker)  # pool -> GPUs per worker
        self.budget = config.budget_gpus(self.gpus)
        self.lengths = (float(config.prior_prompt_tokens), float(config.prior_output_tokens))

    def initial(self) -> dict[str, int]:
        """The planner's warm start (the minimums without an expected load): every adaptive
        policy starts from the same sizes."""
        return warm_start(self.profile, self.config)

    def clamp(self, pool: str, n: int) -> int:
        c = self.config
        lo, hi = (
            (c.min_prefill, c.max_prefill) if pool == PREFILL_POOL else (c.min_decode, c.max_decode)
        )
        return min(max(n, lo), hi)

    def cap(self, pools: PoolCounts) -> int | None:
        """GPUs the budget leaves for both pools; draining workers still hold theirs."""
        if self.budget is None:
            return None
        g, c = self.gpus, self.config
        draining = sum(pools.draining.get(p, 0) * g[p] for p in POOLS)
        floor = c.min_prefill * g[PREFILL_POOL] + c.min_decode * g[DECODE_POOL]
        return max(self.budget - draining, floor)

    def mean_lengths(self, window: WindowSignals) -> tuple[float, float]:
        """The window's mean prompt and output lengths, else the last seen (else the prior)."""
        isl = window.prompt_lengths.mean() or self.lengths[0]
        osl = window.output_lengths.mean() or self.lengths[1]
        self.lengths = (isl, osl)
        return isl, osl

    def finish(
        self, wanted: dict[str, int], have: dict[str, int], why: dict[str, str], budgeted
    ) -> Decision:
        """Clamp to min/max, fit the budget (`budgeted(desired) -> desired`), and explain."""
        desired = {p: self.clamp(p, wanted[p]) for p in POOLS}
        causes = {
            p: "bounds"
            if desired[p] != wanted[p]
            else "demand"
            if desired[p] != have[p]
            else "steady"
            for p in POOLS
        }
        fitted = budgeted(desired)
        reasons = {}
        for p in POOLS:
            if fitted[p] < desired[p]:
                causes[p] = "budget"
            reasons[p] = f"{have[p]} -> {fitted[p]} ({causes[p]}): {why[p]}"
        return Decision(fitted, reasons, causes)


class DynamoStylePolicy(_Bounded):
    """Dynamo's SLA planner on the last interval (see the module doc)."""

    name = "dynamo"

    def __init__(self, profile: CapacityProfile, config: PlannerConfig) -> None:
        super().__init__(profile, config)
        self.prefill_correction = 1.0
        self.decode_correction = 1.0

    def decide(self, now: float, window: WindowSignals, pools: PoolCounts) -> Decision:
        p, c = self.profile, self.config
        rate = window.arrival_rate
        isl, osl = self.mean_lengths(window)
        context = isl + osl / 2
        self._correct(window, pools, rate, isl, osl, context)
        # Prefill is taken as single-batched: the throughput of one ISL-long prompt.
        per_worker = isl / p.prefill_s(isl)
        prefill_load = rate * isl * min(1.0, self.prefill_correction)
        prefill = math.ceil(prefill_load / per_worker - 1e-9)
        itl = c.slo_tpot_s / self.decode_correction if self.decode_correction > 0 else c.slo_tpot_s
        batch = max(1, p.max_decode_batch(context, itl))
        decode_per_worker = batch / p.decode_step_s(batch, batch * context)
        decode = math.ceil(rate * osl / decode_per_worker - 1e-9)
        have = {pool: pools.provisioned(pool) for pool in POOLS}
        why = {
            PREFILL_POOL: (
                f"{prefill_load:.0f} prompt tok/s (x{min(1.0, self.prefill_correction):.2f}) / "
                f"{per_worker:.0f} tok/s per worker at ISL {isl:.0f}"
            ),
            DECODE_POOL: (
                f"{rate * osl:.0f} output tok/s / {decode_per_worker:.0f} tok/s per worker "
                f"(batch {batch}, ITL {itl * 1000:.0f} ms, context {context:.0f})"
            ),
        }
        decision = self.finish(
            {PREFILL_POOL: prefill, DECODE_POOL: decode},
            have,
            why,
            lambda d: self._budget(d, pools),
        )
        decision.predicted.update(
            arrival_rate=rate,
            prefill_tokens_per_s=rate * isl,
            decode_tokens_per_s=rate * osl,
            prefill_correction=self.prefill_correction,
            decode_correction=self.decode_correction,
        )
        return decision

    def _correct(
        self,
        window: WindowSignals,
        pools: PoolCounts,
        rate: float,
        isl: float,
        osl: float,
        context: float,
    ) -> None:
        """observed / expected latency, as Dynamo computes it (no clamp, no sample minimum)."""
        p = self.profile
        if window.ttft.count and isl > 0:
            expected = p.request_overhead_s + p.prefill_s(isl)
            self.prefill_correction = window.ttft.p50 / expected
        ready = pools.ready.get(DECODE_POOL, 0)
        if window.tpot.count and ready > 0:
            # Concurrency per worker by Little's law: rate * request duration / workers.
            duration = window.ttft.p50 + osl * window.tpot.p50
            concurrency = max(rate * duration / ready, 1.0)
            expected = p.decode_step_s(concurrency, concurrency * context) + p.token_overhead_s
            self.decode_correction = window.tpot.p50 / expected

    def _budget(self, desired: dict[str, int], pools: PoolCounts) -> dict[str, int]:
        """Dynamo's rule: over budget, prefill scales down in proportion, decode gets the rest."""
        cap, c = self.cap(pools), self.config
        gp, gd = self.gpus[PREFILL_POOL], self.gpus[DECODE_POOL]
        total = desired[PREFILL_POOL] * gp + desired[DECODE_POOL] * gd  # GPUs
        if cap is None or total <= cap:
            return desired
        prefill = max(c.min_prefill, int(desired[PREFILL_POOL] * cap / total))
        return {PREFILL_POOL: prefill, DECODE_POOL: max(c.min_decode, (cap - prefill * gp) // gd)}


class ThresholdPolicy(_Bounded):
    """An HPA/KEDA-style threshold autoscaler (see the module doc)."""

    name = "threshold"
    TOLERANCE = 0.1
    STABILIZATION_S = 300.0
    KV_TARGET = 0.8

    def __init__(self, profile: CapacityProfile, config: PlannerConfig) -> None:
        super().__init__(profile, config)
        # One worker's worth of queue: what it prefills within the TTFT target.
        self.queue_target = config.slo_ttft_s * profile.prefill_tokens_per_s()
        self.history: dict[str, deque[tuple[float, int]]] = {p: deque() for p in POOLS}

    def decide(self, now: float, window: WindowSignals, pools: PoolCounts) -> Decision:
        p, c = self.profile, self.config
        isl, osl = self.mean_lengths(window)
        batch = max(1, p.max_decode_batch(isl + osl / 2, c.slo_tpot_s))
        ready = {pool: pools.ready.get(pool, 0) for pool in POOLS}
        have = {pool: pools.provisioned(pool) for pool in POOLS}
        queued = float(window.queued_prompt_tokens)
        ratios = {
            PREFILL_POOL: queued / (max(ready[PREFILL_POOL], 1) * self.queue_target),
            DECODE_POOL: max(
                window.kv_usage / self.KV_TARGET,
                (window.decode_running + window.decode_waiting)
                / (max(ready[DECODE_POOL], 1) * batch),
            ),
        }
        wanted = {
            pool: self._recommend(pool, now, have[pool], ready[pool], ratios[pool])
            for pool in POOLS
        }
        why = {
            PREFILL_POOL: (
                f"{queued:.0f} queued prompt tokens, target {self.queue_target:.0f}/worker"
            ),
            DECODE_POOL: (
                f"KV {window.kv_usage:.0%} (target {self.KV_TARGET:.0%}), "
                f"{window.decode_running + window.decode_waiting} sequences, target {batch}/worker"
            ),
        }
        cap = self.cap(pools)
        floors = {PREFILL_POOL: c.min_prefill, DECODE_POOL: c.min_decode}
        g = self.gpus
        return self.finish(wanted, have, why, lambda d: fit_budget(d, have, cap, ratios, floors, g))

    def _recommend(self, pool: str, now: float, have: int, ready: int, ratio: float) -> int:
        """HPA's replica calculation for one pool, with its tolerance, its default scale-up
        limit and its scale-down stabilisation window."""
        if have > 0 and ready == 0:
            return have  # no pod reports a metric yet: HPA holds
        if abs(ratio - 1.0) <= self.TOLERANCE and ready > 0:
            rec = have
        else:
            rec = math.ceil(max(ready, 1) * ratio - 1e-9)
        history = self.history[pool]
        history.append((now, rec))
        while history and history[0][0] < now - self.STABILIZATION_S:
            history.popleft()
        if rec > have:
            return min(rec, max(2 * have, have + 4))
        return min(have, max(r for _, r in history))
