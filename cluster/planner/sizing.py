"""How many workers a `Workload` needs: pure functions of a `CapacityProfile`, the load and
the SLO targets (no state, no clock; the planner and its tests call them directly).

Prefill (TTFT, p90). A prefill worker is a server of `mu` uncached prompt tokens/s (full
steps of `max_batch_tokens`, each prompt paying its own attention: `mix_service`); P workers
are an M/G/P queue fed by the prompts at or above the disaggregation threshold. A step holds
whatever is queued (up to its budget), so the work ahead of a prompt is done at the
full-step rate, and the prompt then takes its own time:

    TTFT p90 = request_overhead + wait_p90(P) + prefill_s(p90 prompt)

(checked against the simulator on the Azure conversation trace: observed / predicted has a
median of 1.0 across utilisations; adding a step in progress and the step's other prompts
over-predicts by 30%, dropping the wait under-predicts 3x near saturation), where wait_p90
is the exponential-tail form of the Allen-Cunneen approximation:
P(wait > t) = ErlangC(P, a) * exp(-t / theta), theta = E[S] (ca^2 + cs^2) / 2 / (P - a),
a = rate * E[S], the service-time SCV cs^2 from the histogram buckets. A queued backlog above
what the target tolerates (rate * TTFT target tokens) must drain on top of the demand within
the target or the planner's interval, the longer: P >= (demand + excess / drain) / mu.

Decode (TPOT). A sequence with prompt p and output o spends o steps at contexts p..p+o, so
the time-weighted context of a running sequence is E[p] + E[o^2] / (2 E[o]) (long answers
stay longer). An answer's first decode token also waits for its KV and a step boundary, which
short answers feel most (`step_goal`). The largest batch B whose step meets that goal at that
context (and whose KV fits the cache) gives a worker B / step(B) tokens/s. Prompts
prefilled on decode workers (shorter than the threshold, or all of them with no prefill pool)
take a share f of each decode worker's time (mixed steps), which stretches every step by
1 / (1 - f): D must carry the output tokens, fit the sequences already in flight, and meet
the TTFT target of those local prefills.

`Corrections` (observed vs predicted latency) scale step times: `prefill` and `decode`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from bench.capacity_profile import CapacityProfile
from bench.prefill_cost import PrefillCost
from engine.slo import ttft_target

from .demand import LengthDist, Workload

# The p90 of a wait whose tail is C * exp(-t / theta): theta * ln(C / (1 - 0.9)).
TAIL = 0.1
BOUNDARY_WAIT = 0.5  # steps a KV that just arrived waits for the next decode step, on average


@dataclass(slots=True, frozen=True)
class Targets:
    """SLO targets and model settings every sizing call shares."""

    slo_ttft_s: float
    slo_tpot_s: float
    headroom: float = 0.1
    disagg_threshold: int = 0
    arrival_scv: float = 1.0
    tpot_tail_share: float = 0.05
    # The share of a window's excess a pool must carry as it comes (demand.queue_share): 1
    # for a tight target; less where requests may queue within their TTFT target, which
    # then also absorbs the rate's error that the utilisation headroom is kept for.
    queue_share: float = 1.0
    # TTFT allowance per 1k prompt tokens (engine.slo.ttft_target's rule).
    ttft_per_1k_s: float = 0.0
    # A backlog drains within this or the TTFT target, the longer (README "The model")
    backlog_drain_s: float = 0.0
    # SDs of the KV a decode batch holds that the cache keeps room for (`kv_batch`); 0 sizes
    # at the mean, which the windows' evidence then corrects (the warm start keeps some).
    kv_sigmas: float = 0.0

    @property
    def ttft_goal(self) -> float:
        return self.slo_ttft_s * (1 - self.headroom)

    def ttft_goal_for(self, prompt_tokens: float) -> float:
        """The TTFT goal of a prompt of this many tokens: its target (the base plus the
        per-1k allowance) less the headroom."""
        return ttft_target(self.slo_ttft_s, self.ttft_per_1k_s, prompt_tokens) * (1 - self.headroom)

    @property
    def tpot_goal(self) -> float:
        return self.slo_tpot_s * (1 - self.headroom)

    @property
    def max_utilisation(self) -> float:
        return 1 - self.headroom * self.queue_share


@dataclass(slots=True, frozen=True)
class Corrections:
    prefill: float = 1.0
    decode: float = 1.0


@dataclass(slots=True, frozen=True)
class PrefillLoad:
    """The prefill pool's share of a workload, with the correction applied."""

    rate: float  # requests/s sent to the prefill pool
    tokens_per_s: float  # their uncached prompt tokens/s
    mu: float  # one worker's uncached tokens/s in full steps
    mean_service_s: float  # E[S] on one server of mu tokens/s
    service_scv: float
    p90_tokens: float  # uncached tokens of the p90 prompt
    backlog_tokens: float  # queued uncached tokens beyond what the TTFT target tolerates
    correction: float

    def corrected(self, factor: float) -> PrefillLoad:
        """The same load on workers whose steps take `factor` times the profile's."""
        scale = _capacity_factor(factor) / _capacity_factor(self.correction)
        return replace(
            self, mu=self.mu / scale, mean_service_s=self.mean_service_s * scale, correction=factor
        )


def _capacity_factor(correction: float) -> float:
    """A correction above 1 (slower steps) lowers a prefill worker's throughput; one below 1
    only shortens its steps. A TTFT lower than predicted says the latency model is pessimistic
    more often than that the worker out-computes its profile, and taking it as extra
    throughput would shrink the pool into saturation."""
    return max(correction, 1.0)


@dataclass(slots=True)
class PrefillPlan:
    workers: int
    cause: str  # "demand", "backlog", or "bounds" (the max binds)
    load: PrefillLoad | None
    ttft_p90_s: float
    met: bool
    note: str = ""


@dataclass(slots=True, frozen=True)
class DecodeLoad:
    rate: float
    tokens_per_s: float  # output tokens/s
    context: float  # time-weighted context tokens per running sequence
    context_sq: float  # its time-weighted second moment
    kv_sigmas: float  # Targets.kv_sigmas
    local_rate: float  # requests/s prefilled on decode workers
    local_work: float  # seconds of decode-worker time per second those prefills take
    local_service_s: float  # E[S] of one local prefill
    local_scv: float
    local_p90_s: float  # the p90 local prompt's own prefill time
    in_flight: int  # sequences running or waiting on the decode pool now
    prefill_corr: float
    decode_corr: float
    step_goal_s: float  # the longest (stretched) step that keeps answers within TPOT


@dataclass(slots=True)
class DecodePlan:
    workers: int
    cause: str  # "demand", "backlog", or "bounds" (the max binds)
    load: DecodeLoad
    batch: int  # largest batch per worker meeting the TPOT target
    tokens_per_s_per_worker: float
    tpot_p50_s: float
    local_ttft_p90_s: float
    met: bool
    note: str = ""


# -- queueing ----------------------------------------------------------------------------------
def erlang_c(servers: int, offered: float) -> float:
    """Probability an arrival waits in M/M/c with `offered` = rate * E[S] (1 when saturated)."""
    if servers < 1 or offered >= servers:
        return 1.0
    if offered <= 0:
        return 0.0
    b = 1.0
    for k in range(1, servers + 1):  # Erlang B by its stable recursion
        b = offered * b / (k + offered * b)
    return b / (1 - (offered / servers) * (1 - b))


def wait_p90(servers: int, offered: float, mean_service_s: float, scv: float) -> float:
    """p90 of the queueing wait (Allen-Cunneen scaled, exponential tail); inf when saturated."""
    if servers < 1 or offered >= servers:
        return math.inf
    c = erlang_c(servers, offered)
    if c <= TAIL or mean_service_s <= 0:
        return 0.0
    theta = mean_service_s * scv / (servers - offered)
    return theta * math.log(c / TAIL)


def _service_moments(times: list[tuple[float, float]]) -> tuple[float, float]:
    """(E[S], SCV) of service times given as (share, seconds)."""
    es = sum(p * s for p, s in times)
    es2 = sum(p * s * s for p, s in times)
    return es, (es2 / (es * es) - 1 if es > 0 else 0.0)


# -- prefill -----------------------------------------------------------------------------------
def prefill_load(
    profile: CapacityProfile, wl: Workload, targets: Targets, correction: float = 1.0
) -> PrefillLoad | None:
    """The part of `wl` the prefill pool serves (None: every prompt is below the threshold)."""
    share, remote, _ = wl.prompts.split(targets.disagg_threshold)
    if remote is None:
        return None
    u = wl.uncached
    mu, times = mix_service(profile, remote, u, correction)
    es, scv = _service_moments(times)
    if u == 0:
        es, scv = 0.0, 0.0
    rate = wl.rate * share
    tokens = rate * remote.mean() * u
    remote_token_share = share * remote.mean() / wl.prompts.mean() if wl.prompts.mean() else 0
    queued = max(wl.queued_prompt_tokens * remote_token_share, wl.prefill_waiting * remote.mean())
    excess = max(0.0, queued * u - tokens * targets.ttft_goal)
    return PrefillLoad(
        rate=rate,
        tokens_per_s=tokens,
        mu=mu,
        mean_service_s=es,
        service_scv=max(scv, 0.0),
        p90_tokens=remote.quantile(0.9) * u,
        backlog_tokens=excess,
        correction=correction,
    )


def mix_service(
    profile: CapacityProfile, prompts: LengthDist, uncached: float = 1.0, correction: float = 1.0
) -> tuple[float, list[tuple[float, float]]]:
    """(one worker's uncached tokens/s on this prompt mix, (share, service seconds) per bucket).
    A prompt's service is its tokens at a full step's per-token cost plus its own attention
    (`PrefillCost.prompt_work_s`, as the simulator charges steps): a worker serves 1k-token
    prompts faster than one 8k-token prompt per step (on the H100 roofline 34.7k against 30.7k
    tok/s), and long prompts slower."""
    cost, scale = prefill_cost(profile), _capacity_factor(correction)
    times = [
        (p, scale * cost.prompt_work_s(m * uncached, m * (1 - uncached)))
        for p, m, _ in prompts.parts
    ]
    work = sum(p * t for p, t in times)
    tokens = prompts.mean() * uncached
    if work <= 0 or tokens <= 0:
        return profile.prefill_tokens_per_s() / scale, times
    return tokens / work, times


def prefill_cost(profile: CapacityProfile) -> PrefillCost:
    """The profile's `PrefillCost` (its attention fit), built once per profile object."""
    entry = _COSTS.get(id(profile))
    if entry is None or entry[0] is not profile:
        if len(_COSTS) > 64:
            _COSTS.clear()
        entry = _COSTS[id(profile)] = (profile, PrefillCost(profile))
    return entry[1]


_COSTS: dict[int, tuple[CapacityProfile, PrefillCost]] = {}


def prefill_ttft_p90(
    profile: CapacityProfile, load: PrefillLoad, workers: int, targets: Targets
) -> float:
    """Predicted TTFT p90 of the prefill path with `workers` workers (inf: overloaded)."""
    if workers < 1:
        return math.inf
    offered = load.rate * load.mean_service_s
    wait = wait_p90(
        workers, offered, load.mean_service_s, (targets.arrival_scv + load.service_scv) / 2
    )
    # The wait is the work queued ahead of it, done at the full-step rate (a step holds
    # what is queued, up to its budget); then its own tokens take the time they take.
    return wait + p90_prompt_alone_s(profile, load)


def p90_prompt_alone_s(profile: CapacityProfile, load: PrefillLoad) -> float:
    """TTFT of the p90 prompt with no queue and no other prompt: the request overhead and
    its own step."""
    return profile.request_overhead_s + load.correction * profile.prefill_s(load.p90_tokens)


def size_prefill(
    profile: CapacityProfile, load: PrefillLoad | None, targets: Targets, lo: int, hi: int
) -> PrefillPlan:
    """The fewest prefill workers in [lo, hi] meeting the TTFT target and draining the backlog."""
    if load is None or load.rate <= 0:
        ttft = prefill_ttft_p90(profile, load, max(lo, 1), targets) if load else 0.0
        return PrefillPlan(lo, "demand", load, ttft, True, "no prompts for the prefill pool")
    need_tput = load.tokens_per_s / (load.mu * targets.max_utilisation)
    # With no queueing and no other prompt, the p90 prompt still takes its own step.
    floor = p90_prompt_alone_s(profile, load)
    by_ttft, met, note = None, True, ""
    # The p90 prompt's own target (its length's allowance counted on its uncached tokens:
    # the cautious side when the cache hits).
    goal = targets.ttft_goal_for(load.p90_tokens)
    if floor > goal:
        by_ttft, met = math.ceil(need_tput), False
        note = f"the p90 prompt alone takes {ms(floor)} > the target: sized for throughput"
    else:
        for n in range(max(lo, 1, math.ceil(need_tput)), hi + 1):
            if prefill_ttft_p90(profile, load, n, targets) <= goal:
                by_ttft = n
                break
    capped = by_ttft is None
    if capped:
        by_ttft, met, note = hi, False, f"{hi} workers (the max) cannot meet the TTFT target"
    drain_s = max(targets.slo_ttft_s, targets.backlog_drain_s)
    by_backlog = math.ceil((load.tokens_per_s + load.backlog_tokens / drain_s) / load.mu)
    wanted = max(by_ttft, by_backlog, lo)
    workers = min(wanted, hi)
    if wanted > hi:
        capped, met = True, False
        note = note or f"{wanted} workers needed, the max is {hi}"
    cause = "backlog" if by_backlog > by_ttft and workers > lo else "demand"
    cause = "bounds" if capped else cause
    ttft = prefill_ttft_p90(profile, load, workers, targets)
    return PrefillPlan(workers, cause, load, ttft, met and ttft <= goal, note)


def burst_spread_s(profile: CapacityProfile, targets: Targets, correction: float = 1.0) -> float:
    """Seconds over which a burst arriving within one second leaves the prefill pool sized by
    `burst_prefill_workers`: the second it arrives in, plus the queue its last prompt may
    wait (the TTFT goal less that prompt's own step)."""
    own = profile.request_overhead_s + correction * profile.prefill_s(profile.max_batch_tokens)
    return 1 + max(targets.ttft_goal - own, 0.0)


def burst_prefill_workers(
    profile: CapacityProfile,
    peak_tokens_1s: float,
    targets: Targets,
    correction: float = 1.0,
    mu: float | None = None,
) -> int:
    """Prefill workers that keep a burst of `peak_tokens_1s` uncached prompt tokens arriving
    within one second under the TTFT target: C tokens/s of capacity leave the burst's last
    prompt (t = 1 s) (X - C) / C s of queue, and its own step takes `own`, so C (1 + goal -
    own) >= X (`burst_spread_s`). `mu`: one worker's tokens/s on the traffic's prompt mix
    (`mix_service`, the correction applied; default: full steps of one prompt). 0 for no
    burst."""
    if peak_tokens_1s <= 0:
        return 0
    if mu is None:
        mu = profile.prefill_tokens_per_s() / _capacity_factor(correction)
    spread = burst_spread_s(profile, targets, correction)
    return math.ceil(peak_tokens_1s / (mu * spread) - 1e-9)


def burst_decode_rate(
    profile: CapacityProfile,
    peak_tokens_1s: float,
    wl: Workload,
    targets: Targets,
    correction: float = 1.0,
) -> float:
    """The request rate whose steady load puts as many sequences in the decode pool as a
    burst of `peak_tokens_1s` uncached prompt tokens within one second does (0 for none).
    The burst's prompts (`peak / mean uncached prompt` of them) leave the prefill pool over
    `burst_spread_s`, and each then lives its answer at the TPOT target: the sequences in
    flight at once are the burst's count times the smaller share of lifetime over spread, as
    many as a steady rate of count / max(spread, lifetime) keeps (Little's law). It binds
    where answers are short and bursts large (Azure code x10: 1,700 TPOT misses at one
    decode worker whose batch of 256 long contexts stepped past 50 ms); answers that outlive
    the spread are the rate's own sizing."""
    per_request = wl.prompts.mean() * wl.uncached
    if peak_tokens_1s <= 0 or per_request <= 0:
        return 0.0
    lifetime = wl.outputs.mean() * targets.slo_tpot_s
    spread = burst_spread_s(profile, targets, correction)
    return peak_tokens_1s / per_request / max(spread, lifetime)


# -- decode ------------------------------------------------------------------------------------
def decode_load(
    profile: CapacityProfile,
    wl: Workload,
    targets: Targets,
    corrections: Corrections,
    local: LengthDist | None,
    local_share: float,
) -> DecodeLoad:
    """The decode pool's work: every output token, plus the prefills of `local` prompts (a
    `local_share` of the requests) done on decode workers."""
    eo = max(wl.outputs.mean(), 1.0)
    # A running sequence holds its prompt and an age uniform over its answer, answers weighted
    # by how long they run: E[age] = E[o^2] / 2E[o], E[age^2] = E[o^3] / 3E[o].
    age = wl.outputs.second_moment() / (2 * eo)
    mean_p = wl.prompts.mean()
    context = mean_p + age
    context_sq = (
        wl.prompts.second_moment() + 2 * mean_p * age + wl.outputs.third_moment() / (3 * eo)
    )
    local_rate = wl.rate * local_share if local is not None else 0.0
    es = scv = p90_s = 0.0
    if local is not None:
        # A mixed step reads the weights once: a prefill adds its time less the fixed part.
        times = [
            (p, corrections.prefill * _local_prefill_s(profile, m * wl.uncached))
            for p, m, _ in local.parts
        ]
        es, scv = _service_moments(times)
        p90_s = corrections.prefill * profile.prefill_s(local.quantile(0.9) * wl.uncached)
    return DecodeLoad(
        rate=wl.rate,
        tokens_per_s=wl.rate * eo,
        context=context,
        context_sq=context_sq,
        kv_sigmas=targets.kv_sigmas,
        local_rate=local_rate,
        local_work=local_rate * es,
        local_service_s=es,
        local_scv=max(scv, 0.0),
        local_p90_s=p90_s,
        in_flight=wl.decode_running + wl.decode_waiting,
        prefill_corr=corrections.prefill,
        decode_corr=corrections.decode,
        step_goal_s=step_goal(profile, wl, targets, 0.0 if local_share >= 1 else None),
    )


def step_goal(
    profile: CapacityProfile, wl: Workload, targets: Targets, transfer_s: float | None = None
) -> float:
    """The longest decode step that keeps all but `tpot_tail_share` of the answers within
    the TPOT target. An answer of n tokens to a prompt of p has TPOT = step + (hand-off +
    wait)/(n - 1) + token overhead: its first token waits for p's KV transfer (none when
    prefilled on decode; `transfer_s` for all when given) and half a step, spread over n - 1
    gaps. Prompt and answer lengths are independent, bucket by bucket (the mean prompt's
    hand-off charged to every short answer sized long-context pools for a rare worst case);
    the `tpot_tail_share` that bind most are let go, and so are answers that would miss even
    alone on a worker (need below a one-sequence step at their prompt's context): no pool
    size saves them, and sizing for them asks for a worker per sequence."""
    goal = targets.tpot_goal - profile.token_overhead_s
    needs = []
    for q, p, _ in wl.prompts.parts:
        remote = profile.transfer_s(p) if p >= targets.disagg_threshold else 0.0
        handoff = remote if transfer_s is None else transfer_s
        alone = profile.decode_step_s(1, p)
        for share, n, _ in wl.outputs.parts:
            if n < 2:
                continue
            need = (goal - handoff / (n - 1)) / (1 + BOUNDARY_WAIT / (n - 1))
            if need >= alone:
                needs.append((need, q * share))
    needs.sort()
    skipped = 0.0
    for need, share in needs:
        if skipped + share > targets.tpot_tail_share:
            return need
        skipped += share
    return goal


def _local_prefill_s(profile: CapacityProfile, tokens: float) -> float:
    return max(0.0, profile.prefill_s(tokens) - profile.decode_fixed_s) if tokens > 0 else 0.0


def decode_batch(profile: CapacityProfile, load: DecodeLoad, share_busy: float) -> int:
    """Largest batch per worker whose step (stretched by local prefills taking `share_busy`
    of the time, and by the decode correction) stays within the load's step goal, and whose
    KV fits the cache; 0 when not even one sequence meets it."""
    room = load.step_goal_s * (1 - share_busy) / load.decode_corr
    per_seq = profile.decode_per_seq_s + profile.decode_per_ctx_token_s * load.context
    by_time = (room - profile.decode_fixed_s) / per_seq if per_seq > 0 else profile.max_num_seqs
    by_kv = kv_batch(profile.kv_capacity_tokens, load.context, load.context_sq, load.kv_sigmas)
    return max(0, int(min(math.floor(by_time), math.floor(by_kv), profile.max_num_seqs)))


def kv_batch(capacity: float, context: float, context_sq: float, sigmas: float) -> float:
    """The largest mean batch b whose KV stays in the cache `sigmas` SDs above its mean: the
    sequences come and go as a Poisson count of varying contexts, so the KV they hold has
    mean b*c and variance b*E[c^2]; b*c + z*sqrt(b*E[c^2]) <= capacity, solved for sqrt(b)."""
    c = max(context, 1.0)
    if sigmas <= 0:
        return capacity / c
    zm = sigmas * math.sqrt(max(context_sq, c * c))
    return ((math.sqrt(zm * zm + 4 * c * capacity) - zm) / (2 * c)) ** 2


def decode_tpot_p50(
    profile: CapacityProfile, load: DecodeLoad, workers: int, batch: float | None = None
) -> float:
    """Predicted TPOT with `workers` decode workers; `batch` per worker if known (observed),
    else Little's law: b = (rate_tokens / D) * step(b) / (1 - f) solved for b. inf: overloaded."""
    if workers < 1:
        return math.inf
    f = load.local_work / workers
    if f >= 1:
        return math.inf
    per_seq = profile.decode_per_seq_s + profile.decode_per_ctx_token_s * load.context
    if batch is None:
        r = load.tokens_per_s * load.decode_corr / (workers * (1 - f))
        if r * per_seq >= 1:
            return math.inf
        batch = r * profile.decode_fixed_s / (1 - r * per_seq)
    step = profile.decode_step_s(max(batch, 1.0), max(batch, 1.0) * load.context)
    return load.decode_corr * step / (1 - f) + profile.token_overhead_s


def local_ttft_p90(
    profile: CapacityProfile, load: DecodeLoad, workers: int, targets: Targets
) -> float:
    """Predicted TTFT p90 of prompts prefilled on decode workers (0 when there are none)."""
    if load.local_rate <= 0:
        return 0.0
    if workers < 1:
        return math.inf
    scv = (targets.arrival_scv + load.local_scv) / 2
    wait = wait_p90(workers, load.local_work, load.local_service_s, scv)
    # It also waits for the step in progress and rides a step with the running batch.
    step = decode_tpot_p50(profile, load, workers) - profile.token_overhead_s
    return profile.request_overhead_s + wait + load.local_p90_s + 2 * step


def _decode_fits(
    profile: CapacityProfile, load: DecodeLoad, n: int, targets: Targets
) -> tuple[int, float, bool, bool]:
    """(batch, tokens/s per worker, carries the demand, fits what is in flight) for n workers."""
    f = load.local_work / n
    if f >= targets.max_utilisation:
        return 0, 0.0, False, False
    batch = decode_batch(profile, load, f)
    if batch < 1:
        return 0, 0.0, False, False
    step = load.decode_corr * profile.decode_step_s(batch, batch * load.context) / (1 - f)
    per_worker = batch / step
    carries = n * per_worker >= load.tokens_per_s
    if load.local_rate > 0:
        carries = carries and local_ttft_p90(profile, load, n, targets) <= targets.ttft_goal
    return batch, per_worker, carries, n * batch >= load.in_flight


def _decode_for_throughput(
    profile: CapacityProfile, load: DecodeLoad, lo: int, hi: int
) -> tuple[int, int, float]:
    """(workers, batch, tokens/s per worker) carrying the demand and what is in flight at the
    largest batch the KV cache holds, latency aside (the target is out of reach anyway)."""
    batch = max(
        1, min(int(profile.kv_capacity_tokens / max(load.context, 1.0)), profile.max_num_seqs)
    )
    step = load.decode_corr * profile.decode_step_s(batch, batch * load.context)
    per_worker = batch / step
    need = max(math.ceil(load.tokens_per_s / per_worker), math.ceil(load.in_flight / batch), lo)
    return min(need, hi), batch, per_worker


def size_decode(
    profile: CapacityProfile, load: DecodeLoad, targets: Targets, lo: int, hi: int
) -> DecodePlan:
    """The fewest decode workers in [lo, hi] meeting the TPOT target (and the TTFT target of
    local prefills) for the demand and for the sequences already in flight."""
    by_demand = chosen = None
    for n in range(max(lo, 1), hi + 1):
        batch, per_worker, carries, fits = _decode_fits(profile, load, n, targets)
        if carries and by_demand is None:
            by_demand = n
        if carries and fits:
            chosen = n
            break
    met, note = True, ""
    if chosen is None:
        chosen, met = hi, False
        batch, per_worker, _, _ = _decode_fits(profile, load, hi, targets)
        note = f"{hi} workers (the max) cannot meet the TPOT target"
        if batch < 1:
            # No pool size meets the target (one sequence's step is already too long): more
            # workers buy nothing, so carry the demand at the batches the KV cache holds.
            chosen, batch, per_worker = _decode_for_throughput(profile, load, lo, hi)
            note = (
                f"no batch keeps TPOT <= {ms(targets.tpot_goal)} (a {ms(load.step_goal_s)} "
                f"step) at {load.context:.0f} context tokens: sized for throughput"
            )
    cause = "backlog" if by_demand is not None and chosen > by_demand else "demand"
    cause = cause if met else "bounds"
    return DecodePlan(
        workers=chosen,
        cause=cause,
        load=load,
        batch=batch,
        tokens_per_s_per_worker=per_worker,
        tpot_p50_s=decode_tpot_p50(profile, load, chosen),
        local_ttft_p90_s=local_ttft_p90(profile, load, chosen, targets),
        met=met,
        note=note,
    )


def ms(seconds: float) -> str:
    """Seconds as whole milliseconds for a reason's text ("inf" when overloaded)."""
    return f"{seconds * 1000:.0f} ms" if math.isfinite(seconds) else "inf"
