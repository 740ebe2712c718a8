"""Demand: length distributions from histograms, the Holt forecast, the tracker's windows."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
from planner_fakes import window

from cluster.planner import demand
from cluster.planner.config import PlannerConfig
from cluster.planner.demand import (
    CENSOR_QUANTILE,
    MIN_ERRORS,
    NOISE_SIGMAS,
    DemandTracker,
    HoltForecast,
    LengthDist,
    _heavier,
)
from router.signals import LengthHistogram


def hist(*lengths: int) -> LengthHistogram:
    h = LengthHistogram()
    for n in lengths:
        h.add(n)
    return h


def test_one_repeated_length_is_exact():
    d = LengthDist.of(hist(*[1000] * 50))
    assert d.mean() == 1000
    # Bucket (512, 1024] with mean 1000: uniform on [976, 1024] -> p90 = 976 + 0.9 * 48.
    assert d.quantile(0.9) == pytest.approx(1019.2)
    assert d.second_moment() == pytest.approx(1000**2 + 24**2 / 3)


def test_quantile_and_moments_follow_the_buckets():
    # 90 prompts of 100 tokens, 10 of 3000: the tail bucket holds the p95.
    d = LengthDist.of(hist(*[100] * 90, *[3000] * 10))
    assert d.mean() == pytest.approx(0.9 * 100 + 0.1 * 3000)
    assert d.quantile(0.5) < 128 < 2048 < d.quantile(0.95) <= 4096
    assert LengthDist.of(LengthHistogram()) is None


def test_split_by_threshold_renormalises_both_parts():
    d = LengthDist.of(hist(*[100] * 75, *[3000] * 25))
    share, above, below = d.split(1000)
    assert share == pytest.approx(0.25)
    assert above.mean() == 3000 and below.mean() == 100
    assert d.split(0)[0] == 1.0 and d.split(0)[2] is None
    assert d.split(10**6)[1] is None


def test_holt_follows_a_ramp_ahead_and_holds_a_constant():
    flat = HoltForecast(0.5, 0.1, 0.85)
    for _ in range(50):
        flat.update(10.0)
    assert flat.forecast(7) == pytest.approx(10.0)
    ramp = HoltForecast(0.5, 0.1, 0.85)
    for i in range(50):
        ramp.update(10.0 + i)
    assert ramp.forecast(7) > 59  # ahead of the last value, the damped trend's reach
    falling = HoltForecast(0.5, 0.1, 0.85)
    for i in range(20):
        falling.update(max(0.0, 10.0 - 2 * i))
    assert falling.forecast(7) == 0.0  # never negative
    assert HoltForecast(0.5, 0.1, 0.85).forecast(3) == 0.0


def test_a_step_up_that_lasts_two_windows_moves_the_level_at_once(monkeypatch):
    """A 2.5x step: after its second window the forecast is the new rate; smoothing alone
    (the detector off) is still far below it, and a single spike or a fall moves no level."""

    def after(rates: list[float]) -> DemandTracker:
        t = DemandTracker(PlannerConfig(interval_s=10), startup_s=60)
        for i, rate in enumerate(rates):
            t.observe(window(10 * i, rate))
        return t

    base = [4.9, 5.1] * 10
    assert after(base + [12.5, 12.5]).holt.forecast(1) == pytest.approx(12.5)
    spike = after(base + [12.5, 5.0])
    assert spike.holt.forecast(1) < 8.0  # one window: the smoothing's share only
    fall = after(base + [1.0, 1.0])
    assert fall.holt.forecast(1) > 1.5  # a fall is left to the smoothing
    monkeypatch.setattr(demand, "SHIFT_WINDOWS", 10**6)
    assert after(base + [12.5, 12.5]).holt.forecast(1) < 11.0


def test_tracker_forecasts_for_the_ready_time_and_scales_up_on_the_last_window():
    t = DemandTracker(PlannerConfig(interval_s=10, up_noise_sigmas=0), startup_s=60)
    assert t.horizon_steps() == 7
    for i in range(20):
        t.observe(window(10 * i, 5.0))
    t.observe(window(200, 40.0))
    assert t.forecast_rate() < 40.0
    assert t.up_rate() == 40.0  # a burst is never smoothed away


def test_scale_up_adds_noise_and_scale_down_needs_margin():
    t = DemandTracker(PlannerConfig(interval_s=10, down_margin=0.15), startup_s=60)
    for i in range(50):
        t.observe(window(10 * i, 40.0))
    # A constant series: no forecast error, so the noise is a window's Poisson count's.
    assert t.noise() == pytest.approx(math.sqrt(40 / 10))
    assert t.up_rate() == pytest.approx(40 + t.config.up_noise_sigmas * 2.0)
    assert t.down_rate() == pytest.approx(40 + max(0.15 * 40, NOISE_SIGMAS * 2.0))
    noisy = DemandTracker(PlannerConfig(interval_s=10), startup_s=60)
    for i in range(50):
        noisy.observe(window(10 * i, 40.0 + (8 if i % 2 else -8)))
    assert noisy.noise() > 8  # the Holt one-step error, well above Poisson's 2
    assert noisy.down_rate() > 40 + NOISE_SIGMAS * 8


def test_tracker_keeps_history_s_of_lengths_then_older_then_the_prior():
    t = DemandTracker(PlannerConfig(history_s=30, default_output_tokens=77), startup_s=0)
    assert t.workload(1.0).prompts.mean() == 1024  # the prior before anything arrived
    assert t.workload(1.0).outputs.mean() == 77
    for i in range(5):
        t.observe(window(10 * i, 10.0, prompt=4000, output=50))
    for i in range(5, 10):
        t.observe(window(10 * i, 10.0, prompt=100, output=50))
    assert t.workload(1.0).prompts.mean() == 100  # only the last 30 s: 300 prompts
    t.observe(window(100, 0.0))  # nothing arrived: the last 30 s hold 200 prompts of 100
    assert t.workload(1.0).prompts.mean() == 100
    t.observe(window(110, 0.0))  # 100 in the last 30 s: older windows fill up to 200
    assert t.workload(1.0).prompts.mean() == pytest.approx((100 * 100 + 100 * 100) / 200)
    t.observe(window(120, 0.0))
    t.observe(window(130, 0.0))  # nothing in the last 30 s: the newest 200 samples
    assert t.workload(1.0).prompts.mean() == 100


def test_a_few_stragglers_do_not_stand_for_the_distribution():
    # After a burst, the last requests to finish are its longest answers: with fewer than
    # 200 samples in history_s, older windows fill in.
    t = DemandTracker(PlannerConfig(history_s=60), startup_s=0)
    for i in range(10):
        t.observe(window(10 * i, 10.0, prompt=1000, output=20))
    straggler = window(100, 0.0)
    straggler.output_lengths.add(1899)
    t.observe(straggler)
    for i in range(11, 17):
        t.observe(window(10 * i, 0.0))
    assert t.workload(1.0).outputs.mean() < 40


def test_tracker_uncached_share_and_last_window_view():
    t = DemandTracker(PlannerConfig(), startup_s=0)
    t.observe(window(0, 1.0, prompt=1000, uncached=0.4))  # 10 prompts: too thin alone
    assert t.workload(1.0).uncached == pytest.approx(0.4)
    assert t.last_window_workload() is None
    t.observe(window(10, 5.0, prompt=8000, uncached=1.0, queued_tokens=12_345))
    last = t.last_window_workload()
    assert last.rate == 5.0 and last.prompts.mean() == 8000 and last.uncached == 1.0
    assert last.queued_prompt_tokens == 12_345


def test_an_expected_rate_is_the_forecasts_prior():
    prior = DemandTracker(PlannerConfig(expected_rate_rps=10.0, forecast_alpha=0.3), 60)
    prior.observe(window(0, 20.0))
    assert prior.holt.level == pytest.approx(0.3 * 20 + 0.7 * 10)  # one noisy sample
    none = DemandTracker(PlannerConfig(forecast_alpha=0.3), startup_s=60)
    none.observe(window(0, 20.0))
    assert none.holt.level == 20.0  # no prior: the first window is all there is


def test_each_forecast_is_scored_against_the_window_it_was_made_for():
    # interval 10 s, start-up 60 s: the forecast made at a window's end is for the window
    # seven later; its error is that window's rate less the forecast.
    t = DemandTracker(PlannerConfig(interval_s=10), startup_s=60)
    rates = [20.0 + (i % 5) * 3 + i * 0.5 for i in range(40)]
    forecasts = []
    for i, rate in enumerate(rates):
        t.observe(window(10 * i, rate))
        forecasts.append(t.forecast_rate())
        scored = max(0, i - 6)
        assert (t.horizon_error(1.0) is None) == (scored < MIN_ERRORS)
    errors = sorted(rates[i + 7] - forecasts[i] for i in range(len(rates) - 7))
    assert t.horizon_error(1.0) == pytest.approx(errors[-1])
    assert t.horizon_error(0.0) == pytest.approx(errors[0])
    assert t.horizon_error(0.5) == pytest.approx(errors[len(errors) // 2])


def test_a_ramp_the_one_step_noise_hides_widens_the_learned_margin():
    config = PlannerConfig(interval_s=10, up_noise_sigmas=0.5)
    steady = DemandTracker(config, startup_s=60)
    for i in range(60):
        steady.observe(window(10 * i, 40.0))
    # A steady load: the forecast meets its windows, the noise margin stands.
    assert steady.up_rate(learned=True) == pytest.approx(steady.up_rate())
    ramp = DemandTracker(config, startup_s=60)
    for i in range(60):
        ramp.observe(window(10 * i, 20.0 + i))  # one more request/s every window
    # Holt follows the ramp a window behind (small one-step error), but its damped trend
    # falls short over the 7 windows of a start-up: the learned margin covers that.
    error = ramp.horizon_error(NormalDist().cdf(0.5))
    assert error > 2 * 0.5 * ramp.noise()
    assert ramp.up_rate(learned=True) == pytest.approx(ramp.forecast_rate() + error)
    assert ramp.up_rate() == pytest.approx(ramp.forecast_rate() + 0.5 * ramp.noise())
    # A pool shrunk by the down rule is not grown back by the learned up rule.
    assert ramp.down_rate(learned=True) >= ramp.up_rate(learned=True)
    # Unscored forecasts are never counted: a tracker with fewer than MIN_ERRORS keeps the
    # noise margin.
    young = DemandTracker(config, startup_s=60)
    for i in range(MIN_ERRORS):
        young.observe(window(10 * i, 20.0 + i))
    assert young.horizon_error(0.5) is None
    assert young.up_rate(learned=True) == pytest.approx(young.up_rate())


def test_answers_finished_in_the_first_seconds_do_not_stand_for_the_mix():
    # Answers are counted when they finish, so the first windows of traffic hold only short
    # ones. With an expected answer of 400 tokens the mix is censored until traffic has run
    # as long as its long answers take (the 0.99 quantile of an exponential 400 at 50 ms:
    # 80-100 s); until then the longer of the expected and the finished mix stands, after
    # it only the windows that ended later count.
    cfg = PlannerConfig(slo_tpot_ms=50, expected_output_tokens=400, history_s=60)
    censor_s = LengthDist.exponential(400).quantile(CENSOR_QUANTILE) * 0.05
    assert 80 < censor_s < 100
    t = DemandTracker(cfg, startup_s=60)
    for i in range(8):  # windows ending 10 .. 80 s: only 50-token answers have finished
        t.observe(window(10 * i, 10.0, output=50))
        assert t.workload(1.0).outputs.mean() == pytest.approx(400, rel=0.02)
    for i in range(8, 12):  # the full answers finish; 100 a window
        t.observe(window(10 * i, 10.0, output=400))
    assert t.workload(1.0).outputs.mean() == pytest.approx(400)  # the 50s are left out
    # Without an operator's expectation the finished answers are all there is, and short
    # ones are not censored for long (their own 0.99 quantile at the TPOT target).
    bare = DemandTracker(PlannerConfig(slo_tpot_ms=50), startup_s=60)
    bare.observe(window(0, 10.0, output=50))
    assert bare.workload(1.0).outputs.mean() == pytest.approx(50)
    # Answers longer than expected stand at once (the longer of the two).
    long = DemandTracker(cfg, startup_s=60)
    long.observe(window(0, 30.0, output=900))
    assert long.workload(1.0).outputs.mean() == pytest.approx(900)


def test_a_length_burst_stands_three_and_a_half_standard_errors_out():
    # Checked every window (360 an hour), a 2-SE test fires on the sampling noise of a
    # heavy-tailed mix about 8 times an hour, a 3-SE one about once (flat synthetic load);
    # a length burst must stand 3.5 SEs out.
    history = LengthDist.of(hist(*[500] * 50, *[1500] * 50))
    se = math.sqrt(history.second_moment() - history.mean() ** 2) / math.sqrt(100)
    for ses, burst in ((2.5, False), (3.1, False), (3.4, False), (3.6, True), (4.0, True)):
        recent = LengthDist.single(history.mean() + ses * se)
        assert _heavier(recent, history, 100) is burst


def test_a_shift_to_longer_prompts_at_the_same_rate_counts_as_forecast_error():
    # The prefill pool computes tokens: prompts that double at a steady 20 req/s double its
    # work, which the request rate does not show. The forecast's error is scored in
    # requests of the mix it was made with: 20 req/s short (Azure conversation x20 had
    # 800 -> 1,270 tokens a prompt within a minute at the same rate).
    t = DemandTracker(PlannerConfig(interval_s=10, history_s=60), startup_s=60)
    for i in range(30):
        t.observe(window(10 * i, 20.0, prompt=1000))
    assert t.horizon_error(1.0) == pytest.approx(0.0, abs=0.5)
    for i in range(30, 34):
        t.observe(window(10 * i, 20.0, prompt=2000))
    assert t.horizon_error(1.0) == pytest.approx(20.0, rel=0.05)
    # Half the prompts cached: the work that reaches the pool is what is scored.
    cached = DemandTracker(PlannerConfig(interval_s=10, history_s=60), startup_s=60)
    for i in range(30):
        cached.observe(window(10 * i, 20.0, prompt=1000))
    for i in range(30, 34):
        cached.observe(window(10 * i, 20.0, prompt=2000, uncached=0.5))
    assert cached.horizon_error(1.0) == pytest.approx(0.0, abs=0.5)
