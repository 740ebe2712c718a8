"""Sizing at the SLO with room to queue: a loose TTFT target lets a burst queue and drain
(the rate averaged over the room, `demand.queue_share`), the utilisation headroom shrinks
with it, and a length-aware TTFT target (`slo_ttft_ms_per_1k`) gives long prompts their
allowance."""

from __future__ import annotations

import random

import pytest
from planner_fakes import follow, pools, round_profile, window

from cluster.planner.config import PlannerConfig
from cluster.planner.demand import DemandTracker, queue_share
from cluster.planner.policy import Planner
from cluster.planner.sizing import Targets
from cluster.planner.types import DECODE_POOL, PREFILL_POOL

PROFILE = round_profile()  # 20k prompt tok/s per prefill worker, a full step takes 0.5 s
P, D = PREFILL_POOL, DECODE_POOL


def test_queue_share_is_the_part_of_a_window_the_room_cannot_absorb():
    assert queue_share(10, 0) == 1.0
    assert queue_share(10, 30) == pytest.approx(0.25)
    assert queue_share(10, -5) == 1.0  # no negative room


def test_a_burst_window_is_sized_at_its_share_when_requests_may_queue():
    t = DemandTracker(PlannerConfig(interval_s=10, up_noise_sigmas=0), startup_s=60)
    for i in range(20):
        t.observe(window(10 * i, 5.0))
    t.observe(window(200, 40.0))
    f = t.forecast_rate()
    assert t.up_rate() == 40.0  # no room: the burst's own rate
    # 30 s of room: the window's excess drains within it, C >= (40 W + f room) / (W + room).
    assert t.up_rate(30.0) == pytest.approx(0.25 * 40 + 0.75 * f)
    assert t.down_rate(30.0) < t.down_rate()  # and the survivors' check alike


def test_loose_ttft_target_sizes_a_burst_below_a_tight_one():
    sizes = {}
    for ttft_ms in (1000, 30000):
        cfg = PlannerConfig(
            slo_ttft_ms=ttft_ms, slo_tpot_ms=50, max_prefill=16, max_decode=16, startup_s=5
        )  # a start-up shorter than the window: the burst is sized, at its share
        planner = Planner(PROFILE, cfg)
        have = follow(planner, [window(10 * i, 8) for i in range(12)], start=(1, 2))[-1]
        d = planner.decide(130, window(120, 40), pools(*have))  # 40k prompt tok/s for 10 s
        sizes[ttft_ms] = d.desired[P]
    assert sizes[1000] >= 3  # 40k tok/s now, at 20k per worker and 90% utilisation
    assert sizes[30000] < sizes[1000]


def test_length_aware_goal_adds_the_allowance_per_1k_prompt_tokens():
    t = Targets(1.0, 0.05, headroom=0.1, ttft_per_1k_s=0.5)
    assert t.ttft_goal_for(0) == pytest.approx(0.9)
    assert t.ttft_goal_for(4000) == pytest.approx((1.0 + 2.0) * 0.9)
    # The prefill pool for 4k-token prompts: a 1 s target plus 0.5 s per 1k is met by fewer
    # workers than the 1 s target alone.
    sizes = []
    for per_1k in (0.0, 500.0):
        cfg = PlannerConfig(slo_ttft_ms=1000, slo_ttft_ms_per_1k=per_1k, max_prefill=16)
        planner = Planner(PROFILE, cfg)
        windows = [window(10 * i, 4, prompt=4000) for i in range(12)]
        sizes.append(follow(planner, windows, start=(1, 2))[-1][0])
    assert sizes[1] < sizes[0]


def test_the_per_1k_allowance_must_not_be_negative():
    with pytest.raises(ValueError, match="slo_ttft_ms_per_1k"):
        PlannerConfig(slo_ttft_ms_per_1k=-1)


def test_a_spike_gone_before_a_start_up_starts_no_worker():
    # One window at 8x the rate. A worker asked for now serves after the 60 s start-up; the
    # spike's work is done within the window plus its queue room (prefill, 1 s target: none)
    # or its sequences' lifetime (decode, 200 tokens at 50 ms: 10 s), so neither pool grows
    # for it beyond what the forecast's level moves. With a 5 s start-up the same spike
    # outlives it and both pools grow at once.
    t = DemandTracker(PlannerConfig(interval_s=10, up_noise_sigmas=0), startup_s=60)
    for i in range(20):
        t.observe(window(10 * i, 5.0))
    t.observe(window(200, 40.0))
    assert t.up_rate(0.0, spike_s=10.0) == pytest.approx(t.forecast_rate())
    assert t.up_rate(0.0, spike_s=50.0) == 40.0  # its work outlives the start-up
    assert t.up_rate(0.0) == 40.0  # no lifetime given: sized as before
    grew = {}
    for startup_s in (60.0, 5.0):
        cfg = PlannerConfig(slo_tpot_ms=50, max_prefill=16, max_decode=16, startup_s=startup_s)
        planner = Planner(PROFILE, cfg)
        have = follow(planner, [window(10 * i, 5) for i in range(20)], start=(1, 1))[-1]
        d = planner.decide(210, window(200, 40), pools(*have))
        grew[startup_s] = (d.desired[P] - have[0], d.desired[D] - have[1])
    # (The Holt level still moves toward the spike: the prefill pool may grow by that much.)
    assert grew[60.0][1] == 0 and grew[5.0][1] > 0
    assert grew[60.0][0] < grew[5.0][0]


def test_a_window_of_long_answers_starts_no_decode_worker_a_start_up_away():
    # Answers are counted when they finish: a window whose finished answers are 16x longer
    # is decode work that is already done, and the sequences still running are what fill the
    # pool. With a 60 s start-up (a 100-token answer's life at 50 ms is 5 s) the decode pool
    # sizes for the history, which takes the window in, not for the window alone; with a 5 s
    # start-up a spike outlives it and the window's own mix is sized at once. A window of
    # long prompts (counted on arrival, their work still to come) grows the prefill pool
    # either way.
    grew = {}
    for startup_s in (60.0, 5.0):
        cfg = PlannerConfig(slo_tpot_ms=50, max_prefill=16, max_decode=16, startup_s=startup_s)
        planner = Planner(PROFILE, cfg)
        have = follow(planner, [window(10 * i, 5, output=100) for i in range(20)], start=(1, 1))
        d = planner.decide(210, window(200, 5, output=1600), pools(*have[-1]))
        grew[startup_s] = d.desired[D] - have[-1][1]
    assert 0 <= grew[60.0] < grew[5.0]
    planner = Planner(PROFILE, PlannerConfig(max_prefill=16, max_decode=16, startup_s=60.0))
    have = follow(planner, [window(10 * i, 5, prompt=1000) for i in range(20)], start=(1, 1))
    d = planner.decide(210, window(200, 5, prompt=16000), pools(*have[-1]))
    assert d.desired[P] > have[-1][0]


def test_the_level_smooths_over_the_room_by_the_square_root_of_its_share():
    t = DemandTracker(PlannerConfig(interval_s=10), startup_s=60)
    t.observe(window(0, 10.0))
    t.level_share = 0.25  # a window and 30 s of room
    t.observe(window(10, 12.0))  # within the noise: smoothed, not re-levelled
    assert t.holt.level == pytest.approx(10.0 + 0.3 * 0.5 * 2.0)
    t.level_share = 1.0  # a tight target: alpha itself
    level, trend = t.holt.level, t.holt.trend
    t.observe(window(20, 12.0))
    assert t.holt.level == pytest.approx(0.3 * 12.0 + 0.7 * (level + 0.85 * trend))


def test_the_planner_sets_the_level_share_from_its_prefill_queue_room():
    shares = {}
    for ttft_ms in (1000, 30000):
        cfg = PlannerConfig(slo_ttft_ms=ttft_ms, slo_tpot_ms=50, max_prefill=16, max_decode=16)
        planner = Planner(PROFILE, cfg)
        follow(planner, [window(10 * i, 8) for i in range(3)], start=(1, 2))
        shares[ttft_ms] = planner.demand.level_share
    # 30 s: a prompt may queue ~26 s (goal less its own step), so a window is ~0.28 of it.
    assert shares[30000] == pytest.approx(10 / (10 + 26), abs=0.05)
    assert shares[1000] > 0.9  # 1 s: hardly any room, the level moves as before


def test_a_steady_noisy_load_under_a_loose_target_keeps_its_pool():
    """Poisson noise of 30 requests a window under a 30 s target: the level no longer follows
    each window, so the pool the mean needs is not grown by the noisy windows (the Mooncake
    conversation slice's third prefill worker). Without the room's smoothing it is."""
    rng = random.Random(4)
    rates = [max(0.5, rng.gauss(2.6, 0.51)) for _ in range(60)]  # 31k tok/s on 20k workers
    windows = [window(10 * i, r, prompt=12_000) for i, r in enumerate(rates)]
    sizes = {}
    for smooth in (True, False):
        cfg = PlannerConfig(slo_ttft_ms=30000, slo_tpot_ms=100, max_prefill=16, max_decode=16)
        planner = Planner(PROFILE, cfg)
        have, trail = [2, 2], []
        for w in windows:
            d = planner.decide(w.start_s + w.duration_s, w, pools(*have))
            have = [d.desired[P], d.desired[D]]
            trail.append(have[0])
            if not smooth:  # the level as it moved before: alpha whatever the room
                planner.demand.level_share = 1.0
        sizes[smooth] = trail
    assert set(sizes[True]) == {2}, sizes  # 78% of two workers, 30 s of room: two hold
    assert max(sizes[False]) == 3, sizes  # the level followed the noise up
