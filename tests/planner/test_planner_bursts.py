"""Bursts, backlogs and warm starts: the burst hold (a 1-s prompt peak held with a decaying
half-life), scale-ups only for the backlog a new worker would still find, proportional
scale-down, and the warm start every adaptive policy shares."""

from __future__ import annotations

import math
import random
from dataclasses import replace

from planner_fakes import follow, pools, round_profile, window

from cluster.planner import make_policy, policy
from cluster.planner.config import PlannerConfig
from cluster.planner.demand import LengthDist, Workload
from cluster.planner.policy import Planner, warm_start
from cluster.planner.sizing import (
    Targets,
    burst_decode_rate,
    burst_prefill_workers,
    burst_spread_s,
)
from cluster.planner.types import DECODE_POOL, PREFILL_POOL

PROFILE = round_profile()  # 20k prompt tok/s per prefill worker, a full step takes 0.5 s
P, D = PREFILL_POOL, DECODE_POOL


def config(**overrides) -> PlannerConfig:
    fields = dict(
        slo_ttft_ms=1000, slo_tpot_ms=50, max_prefill=16, max_decode=16, up_noise_sigmas=0
    )
    fields.update(overrides)
    return PlannerConfig(**fields)


def expected_load(output: int, peak: int, **overrides) -> PlannerConfig:
    """A warm start's expected load: 2 req/s of 1k-token prompts, `output`-token answers and
    a 1-s peak of `peak` prompt tokens."""
    return config(
        expected_rate_rps=2,
        expected_prompt_tokens=1000,
        expected_output_tokens=output,
        expected_peak_prompt_tokens_1s=peak,
        **overrides,
    )


def with_peak(w, peak: int):
    w.peak_prompt_tokens_1s = peak
    return w


def test_burst_workers_clear_a_one_second_burst_within_the_target():
    t = Targets(1.0, 0.05)  # goal 0.9 s; own full step 0.5 s: C * 1.4 >= X
    assert burst_prefill_workers(PROFILE, 0, t) == 0
    assert burst_prefill_workers(PROFILE, 28_000, t) == 1
    assert burst_prefill_workers(PROFILE, 28_001, t) == 2
    assert burst_prefill_workers(PROFILE, 140_000, t) == 5
    # Slower workers (correction 2) need twice as many.
    assert burst_prefill_workers(PROFILE, 140_000, t, correction=2.0) > 5


def test_a_burst_grows_the_prefill_pool_and_the_hold_decays():
    planner = Planner(PROFILE, config(down_cooldown_s=0, burst_half_life_s=60))
    quiet = [window(10 * i, 2) for i in range(6)]
    follow(planner, quiet)
    burst = with_peak(window(60, 2), 140_000)
    d = planner.decide(70, burst, pools(1, 1))
    assert d.desired[P] == 5 and "burst hold" in d.reasons[P]
    have, sizes = [5, d.desired[D]], []
    for i in range(60):  # ten minutes of quiet: ten half-lives
        w = window(70 + 10 * i, 2)
        d = planner.decide(80 + 10 * i, w, pools(*have))
        have = [d.desired[P], d.desired[D]]
        sizes.append(have[0])
    assert sizes[:3] == [5, 5, 5]  # held while the peak is fresh
    assert sizes[-1] == 1 and all(b <= a for a, b in zip(sizes, sizes[1:], strict=False))


def test_the_burst_hold_gives_a_worker_back_only_with_down_margin_to_spare():
    # 1-s peaks are heavy-tailed: a hold that had just decayed under a size was pushed back
    # over it by the next window's peak, 3 -> 2 -> 3 within a minute (ServeGen 10:00). So
    # a pool goes below the hold only when the peak plus down_margin needs fewer workers,
    # the hysteresis the rate rules have.
    cfg = config(down_cooldown_s=0, burst_half_life_s=300)
    planner = Planner(PROFILE, cfg)
    follow(planner, [window(10 * i, 2) for i in range(6)])
    d = planner.decide(70, with_peak(window(60, 2), 140_000), pools(1, 1))
    have, margin_held, t = [d.desired[P], d.desired[D]], 0, Targets(1.0, 0.05)
    for i in range(150):  # 25 minutes of quiet, five half-lives
        d = planner.decide(80 + 10 * i, window(70 + 10 * i, 2), pools(*have))
        peak = planner.demand.held_peak_tokens_1s
        with_margin = burst_prefill_workers(PROFILE, peak * (1 + cfg.down_margin), t)
        assert d.desired[P] >= min(with_margin, have[0])
        margin_held += d.desired[P] == with_margin > burst_prefill_workers(PROFILE, peak, t)
        have = [d.desired[P], d.desired[D]]
    assert margin_held >= 3 and have[0] == 1  # the margin kept workers, then let go


def test_no_burst_hold_when_it_is_off():
    planner = Planner(PROFILE, config(burst_half_life_s=0))
    d = planner.decide(10, with_peak(window(0, 2), 140_000), pools(1, 1))
    assert d.desired[P] == 1


def test_a_steady_load_with_steady_peaks_does_not_oscillate():
    planner = Planner(PROFILE, config())
    rng = random.Random(3)
    windows = [with_peak(window(10 * i, 40), 60_000 + rng.randrange(5_000)) for i in range(200)]
    sizes = follow(planner, windows)
    changes = sum(1 for a, b in zip(sizes[20:], sizes[21:], strict=False) if a != b)
    assert changes == 0


def test_the_budget_holds_under_the_burst_hold():
    planner = Planner(PROFILE, config(gpu_budget=6))
    have = [1, 1]
    for i in range(30):
        w = with_peak(window(10 * i, 30), 500_000 if i % 7 == 0 else 0)
        d = planner.decide(10 * i + 10, w, pools(*have))
        have = [d.desired[P], d.desired[D]]
        assert sum(have) <= 6


def test_only_the_backlog_left_after_a_start_up_adds_workers():
    # 4 ready workers (80k tok/s) against 20k tok/s arriving drain 60k tok/s: 3.6M tokens
    # in a 60 s start-up. A 1M-token queue is gone before a new worker serves; of 4.6M, 1M
    # are left: 982k over what the target tolerates, drained within a 10 s window (the
    # planner's interval, longer than the 1 s target) by 6 workers.
    small, large = (
        Planner(PROFILE, config()).decide(10, window(0, 20, queued_tokens=q), pools(4, 2))
        for q in (1_000_000, 4_600_000)
    )
    assert small.desired[P] <= 4
    assert large.desired[P] == 6 and large.causes[P] == "backlog"


def test_workers_already_starting_drain_a_backlog_before_new_ones_would():
    # Asked for 2 workers at t = 10 for a 4.6M-token queue; 30 s later the queue is 5.6M and
    # they are half-way through their start-up: 4 ready + 2 x 0.5 serve 5 workers' worth
    # until a worker asked for now is ready, 80k tok/s over the 20k arriving, 4.8M in 60 s.
    # The 0.8M left is carried by the 6 already there; counted as 4 ready alone, the 2M left
    # asked for 11.
    planner = Planner(PROFILE, config(up_cooldown_s=0))
    first = planner.decide(10, window(0, 20, queued_tokens=4_600_000), pools(4, 2))
    assert first.desired[P] == 6
    later = window(30, 20, queued_tokens=5_600_000)
    assert planner.decide(40, later, pools(4, 2, starting=(2, 0))).desired[P] == 6
    fresh = Planner(PROFILE, config(up_cooldown_s=0))  # no record of when they were asked
    assert fresh.decide(40, later, pools(4, 2, starting=(2, 0))).desired[P] > 6


def test_decode_sequences_waiting_for_a_slot_count_only_if_a_start_up_leaves_them(monkeypatch):
    # 500 sequences waiting behind 100 running, 100-token answers: a slot frees every
    # 5 s / 169 (100 tokens at the 50 ms target, batch 169 at this context), so the ready
    # worker admits (169 / 5 - 20 arriving) x 60 s = 828 before a new worker would serve.
    def decode_after(waiting: int) -> int:
        w = window(0, 20, decode_running=100, decode_waiting=waiting)
        return Planner(PROFILE, config()).decide(10, w, pools(1, 1)).desired[D]

    assert decode_after(500) == 1
    assert decode_after(5000) > 1  # 4,172 are still waiting then
    monkeypatch.setattr(policy, "residual_decode", lambda *args: args[2])
    assert decode_after(500) == 4  # each waiting sequence counted as needing a slot now


def test_a_large_surplus_comes_down_a_share_at_a_time():
    planner = Planner(PROFILE, config(down_cooldown_s=0, down_stable_windows=1))
    cut = planner.decide(10, window(0, 2), pools(16, 16)).desired
    assert cut == {P: 12, D: 12}  # 25% of 16, more than down_step = 1
    slow = Planner(PROFILE, config(down_cooldown_s=0, down_stable_windows=1, down_fraction=0))
    assert slow.decide(10, window(0, 2), pools(16, 16)).desired == {P: 15, D: 15}


def test_every_adaptive_policy_shares_the_warm_start_and_keeps_it_a_cooldown():
    cfg = config(expected_rate_rps=40, expected_prompt_tokens=1000, expected_output_tokens=200)
    warm = warm_start(PROFILE, cfg)
    assert warm[P] > 1 and warm[D] >= 1
    for spec in ("planner", "dynamo", "threshold"):
        assert make_policy(spec, PROFILE, cfg).initial() == warm
    # The first quiet windows do not undo it before the down cooldown.
    planner = Planner(PROFILE, cfg)
    sizes = follow(planner, [window(10 * i, 1) for i in range(6)], start=(warm[P], warm[D]))
    assert sizes[0] == (warm[P], warm[D]) and sizes[5] == (warm[P], warm[D])


def test_the_warm_start_keeps_room_in_the_decode_kv(monkeypatch):
    # An expected load that fills four decode workers' KV to ~97% at its mean: no window has
    # checked it yet, so the warm start asks for a fifth (2 SDs of the KV in flight).
    kv_bound = round_profile(kv_capacity_tokens=50_000)
    cfg = config(expected_rate_rps=80, expected_prompt_tokens=1000, expected_output_tokens=100)
    warm, roomy_kv = warm_start(kv_bound, cfg), warm_start(PROFILE, cfg)
    monkeypatch.setattr(policy, "WARM_KV_SIGMAS", 0.0)
    at_mean = warm_start(kv_bound, cfg)
    assert (at_mean[D], warm[D]) == (4, 5) and warm[P] == at_mean[P]
    # Far from the KV limit (20x the cache) the room costs nothing.
    assert roomy_kv == warm_start(PROFILE, cfg)


def test_the_exponential_prior_has_its_mean_and_a_long_tail():
    dist = LengthDist.exponential(200)
    assert math.isclose(dist.mean(), 200, rel_tol=0.05)
    assert dist.quantile(0.99) > 3 * 200 > 200 > dist.quantile(0.1)
    assert dist.second_moment() > 1.5 * 200**2  # 2 m^2 for an exponential


def test_the_default_hold_outlasts_the_quiet_minutes_between_bursts():
    # Bursts on the Azure code trace recur after 5-10 quiet minutes: the default half-life
    # still holds most of a burst's workers 10 minutes on (a 300 s one would keep 2 of 5).
    planner = Planner(PROFILE, config(down_cooldown_s=0))
    follow(planner, [window(10 * i, 2) for i in range(6)])
    d = planner.decide(70, with_peak(window(60, 2), 140_000), pools(1, 1))
    have = [d.desired[P], d.desired[D]]
    assert have[0] == 5
    for i in range(60):  # ten minutes of quiet
        d = planner.decide(80 + 10 * i, window(70 + 10 * i, 2), pools(*have))
        have = [d.desired[P], d.desired[D]]
    peak = 140_000 * 0.5 ** (600 / PlannerConfig().burst_half_life_s)
    assert have[0] == burst_prefill_workers(PROFILE, peak, Targets(1.0, 0.05)) >= 3


def test_an_expected_burst_is_held_from_the_start_and_decays_like_a_seen_one():
    cfg = expected_load(200, 140_000, burst_half_life_s=60, down_cooldown_s=0)
    warm = warm_start(PROFILE, cfg)
    assert warm[P] == burst_prefill_workers(PROFILE, 140_000, Targets(1.0, 0.05)) == 5
    assert warm_start(PROFILE, replace(cfg, expected_peak_prompt_tokens_1s=None))[P] == 1
    for spec in ("planner", "dynamo", "threshold"):  # every adaptive policy starts there
        assert make_policy(spec, PROFILE, cfg).initial() == warm
    planner = Planner(PROFILE, cfg)
    assert planner.demand.held_peak_tokens_1s == 140_000
    sizes = follow(planner, [window(10 * i, 2) for i in range(60)], start=(warm[P], warm[D]))
    assert sizes[0][0] == 5 and sizes[-1][0] == 1  # ten half-lives of quiet: let go
    off = Planner(PROFILE, replace(cfg, burst_half_life_s=0))
    assert off.demand.held_peak_tokens_1s == 0  # no hold: no expected burst either


def test_a_burst_puts_its_count_over_the_longer_of_spread_and_lifetime_in_flight():
    t = Targets(1.0, 0.05)
    spread = burst_spread_s(PROFILE, t)  # 1 s of arrivals + 0.9 s goal - 0.5 s own step
    assert math.isclose(spread, 1.4)

    def rate(output: int, peak: float = 1_000_000, uncached: float = 1.0) -> float:
        wl = Workload(2.0, LengthDist.single(1000), LengthDist.single(output), uncached)
        return burst_decode_rate(PROFILE, peak, wl, t)

    # 1,000 prompts of 1k tokens: 10-token answers live 0.5 s, shorter than the spread,
    # so 1000 / 1.4 s keeps as many in flight; 200-token answers live 10 s, all at once.
    assert math.isclose(rate(10), 1000 / 1.4)
    assert math.isclose(rate(200), 1000 / 10)
    assert math.isclose(rate(10, uncached=0.5), 2000 / 1.4)  # cached tokens: more prompts
    assert rate(10, peak=0) == 0


def test_a_burst_of_short_answers_holds_decode_workers_as_it_holds_prefill_ones():
    # Azure code x10: a burst of prompts with ~28-token answers filled one decode worker's
    # 256 slots with long contexts and stepped past the TPOT target (1,700 misses); the
    # rate of the window alone sized one worker.
    def run(half_life: float) -> list[tuple[int, int]]:
        planner = Planner(PROFILE, config(down_cooldown_s=0, burst_half_life_s=half_life))
        follow(planner, [window(10 * i, 2, output=10) for i in range(6)])
        d = planner.decide(70, with_peak(window(60, 2, output=10), 1_000_000), pools(16, 1))
        have, sizes = [d.desired[P], d.desired[D]], [(d.desired[P], d.desired[D])]
        assert half_life == 0 or "burst hold" in d.reasons[D]
        for i in range(90):  # 15 minutes of quiet
            d = planner.decide(80 + 10 * i, window(70 + 10 * i, 2, output=10), pools(*have))
            have = [d.desired[P], d.desired[D]]
            sizes.append(tuple(have))
        return sizes

    held, off = run(60), run(0)
    assert held[0][1] >= 2 and off[0][1] == 1 and all(s[1] == 1 for s in off)
    assert held[-1][1] == 1  # and let go as the peak decays, as the prefill hold does


def test_an_expected_burst_of_short_answers_warms_the_decode_pool():
    cfg = expected_load(10, 1_000_000)
    assert warm_start(PROFILE, cfg)[D] >= 2
    assert warm_start(PROFILE, replace(cfg, expected_output_tokens=200))[D] >= 2  # 1,000 live
    assert warm_start(PROFILE, replace(cfg, expected_peak_prompt_tokens_1s=None))[D] == 1
