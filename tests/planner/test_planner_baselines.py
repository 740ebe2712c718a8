"""The baselines' formulas by hand on the round profile, and make_policy's spec parsing."""

from __future__ import annotations

import math

import pytest
from planner_fakes import pools, round_profile, window

from cluster.planner import (
    ColocatedPolicy,
    DynamoStylePolicy,
    Planner,
    PlannerConfig,
    StaticPolicy,
    ThresholdPolicy,
    make_policy,
)
from cluster.planner.types import COLOCATED_POOL, DECODE_POOL, PREFILL_POOL

PROFILE = round_profile()
P, D = PREFILL_POOL, DECODE_POOL
CFG = PlannerConfig(slo_ttft_ms=1000, slo_tpot_ms=50, max_prefill=16, max_decode=16)
# Dynamo's decode capacity at ISL 1000 + OSL 100 / 2 = 1050 context, ITL 50 ms:
# B = floor((0.05 - 0.01) / (1e-4 + 1050e-7)) = 195; 195 / (0.01 + 195 * 2.05e-4) tok/s.
DYNAMO_DECODE = 195 / (0.01 + 195 * 2.05e-4)


def test_static_and_colocated_are_fixed():
    s = StaticPolicy(2, 3)
    assert s.initial() == {P: 2, D: 3}
    d = s.decide(10, window(0, 500), pools(1, 1))
    assert d.desired == {P: 2, D: 3} and d.causes == {P: "static", D: "static"}
    c = ColocatedPolicy(4)
    assert c.decide(10, window(0, 0), pools(0, 0)).desired == {COLOCATED_POOL: 4}
    with pytest.raises(ValueError, match="decode >= 1"):
        StaticPolicy(1, 0)
    with pytest.raises(ValueError, match="replicas"):
        ColocatedPolicy(0)


def test_dynamo_sizes_by_throughput_on_the_last_interval():
    dyn = DynamoStylePolicy(PROFILE, CFG)
    d = dyn.decide(10, window(0, 50, 1000, 100), pools(1, 1))
    # Prefill: 50 req/s * 1000 tokens over one 1000-token prompt's 20k tok/s -> ceil(2.5).
    assert d.desired[P] == 3
    assert d.desired[D] == math.ceil(50 * 100 / DYNAMO_DECODE) == 2
    # At once in both directions: the next quiet interval drops to the minimum.
    assert dyn.decide(20, window(10, 1, 1000, 100), pools(3, 2)).desired == {P: 1, D: 1}


def test_dynamo_corrections_are_observed_over_expected_unclamped():
    dyn = DynamoStylePolicy(PROFILE, CFG)
    # Expected TTFT of a 1000-token prompt: 0.05 s. Observed 0.2 s: factor 4, but Dynamo
    # only lets a prefill factor below 1 change the load (min(1, factor)).
    d = dyn.decide(10, window(0, 50, 1000, 100, ttft=0.2), pools(3, 2))
    assert dyn.prefill_correction == pytest.approx(4.0) and d.desired[P] == 3
    d = dyn.decide(20, window(10, 50, 1000, 100, ttft=0.025), pools(3, 2))
    assert dyn.prefill_correction == pytest.approx(0.5) and d.desired[P] == math.ceil(2.5 * 0.5)
    # Decode: concurrency = 50 req/s * (0.025 + 100 * 0.04) s / 2 workers; expected ITL is
    # the step at that batch; a slower observation shrinks the ITL target by the ratio.
    tpot = 0.04
    dyn.decide(30, window(20, 50, 1000, 100, ttft=0.05, tpot=tpot), pools(3, 2))
    conc = 50 * (0.05 + 100 * tpot) / 2
    expected = 0.01 + conc * (1e-4 + 1050e-7)
    assert dyn.decode_correction == pytest.approx(tpot / expected)


def test_dynamo_budget_scales_prefill_and_gives_decode_the_rest():
    dyn = DynamoStylePolicy(PROFILE, PlannerConfig(max_prefill=16, max_decode=16, gpu_budget=10))
    d = dyn.decide(10, window(0, 300, 1000, 100), pools(1, 1))
    # Wanted 15 + 9 = 24 > 10: prefill int(15 * 10 / 24) = 6, decode the other 4.
    assert (d.desired[P], d.desired[D]) == (6, 4) and d.causes[P] == "budget"


def test_threshold_scales_on_queue_and_kv_like_an_hpa():
    th = ThresholdPolicy(PROFILE, CFG)
    target = 1.0 * 20_000  # one worker's tokens prefilled within the TTFT target
    d = th.decide(10, window(0, 10, queued_tokens=int(3 * target)), pools(1, 1))
    assert d.desired[P] == 3
    # Within the 10% tolerance: no change.
    d = th.decide(20, window(10, 10, queued_tokens=int(3.2 * target)), pools(3, 1))
    assert d.desired[P] == 3
    # KV at 96% of the fullest worker against 80%: ceil(2 * 1.2) = 3 decode workers.
    d = th.decide(30, window(20, 10, kv_usage=0.96), pools(3, 2))
    assert d.desired[D] == 3


def test_threshold_scale_up_is_rate_limited_and_down_is_stabilised():
    th = ThresholdPolicy(PROFILE, CFG)
    target = 20_000
    d = th.decide(10, window(0, 10, queued_tokens=40 * target), pools(1, 1))
    assert d.desired[P] == 5  # max(2 x 1, 1 + 4)
    d = th.decide(20, window(10, 10, queued_tokens=40 * target), pools(5, 1))
    assert d.desired[P] == 10
    # Quiet from now: the 300 s window remembers the 40 recommended at t=20.
    quiet = [
        th.decide(30 + 10 * i, window(20 + 10 * i, 1), pools(10, 1)).desired[P] for i in range(31)
    ]
    assert quiet[:30] == [10] * 30 and quiet[30] == 1


def test_threshold_without_ready_workers_holds():
    th = ThresholdPolicy(PROFILE, CFG)
    d = th.decide(10, window(0, 10, queued_tokens=10**6), pools(0, 1, starting=(2, 0)))
    assert d.desired[P] == 2


def test_adaptive_baselines_respect_bounds_and_budget():
    cfg = PlannerConfig(max_prefill=4, max_decode=3, gpu_budget=6)
    for policy in (DynamoStylePolicy(PROFILE, cfg), ThresholdPolicy(PROFILE, cfg)):
        have = [1, 1]
        for i, rate in enumerate([900, 900, 0, 900]):
            w = window(
                10 * i, rate, 4000, 500, queued_tokens=10**7, kv_usage=1.0, decode_running=900
            )
            d = policy.decide(10 * i + 10, w, pools(*have, draining=(1, 0)))
            have = [d.desired[P], d.desired[D]]
            assert have[0] <= 4 and have[1] <= 3 and sum(have) + 1 <= 6


def test_make_policy_parses_every_spec():
    assert isinstance(make_policy("planner", PROFILE, CFG), Planner)
    assert isinstance(make_policy("dynamo", PROFILE, CFG), DynamoStylePolicy)
    assert isinstance(make_policy(" threshold ", PROFILE, CFG), ThresholdPolicy)
    assert make_policy("static:2:3", PROFILE, CFG).initial() == {P: 2, D: 3}
    assert make_policy("static:0:3", PROFILE, CFG).initial() == {P: 0, D: 3}
    assert make_policy("colocated:5", PROFILE, CFG).initial() == {COLOCATED_POOL: 5}


@pytest.mark.parametrize(
    "spec",
    ["", "plan", "planner:2", "static:1", "static:a:b", "static:1:0", "colocated:0", "colocated"],
)
def test_make_policy_names_a_bad_spec(spec):
    with pytest.raises(ValueError, match=f"policy '{spec}'"):
        make_policy(spec, PROFILE, CFG)
