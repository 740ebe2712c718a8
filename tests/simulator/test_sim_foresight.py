"""The foresight bound (cluster/simulator/foresight.py): the prefill pool sized for the load
of the next start-up read from the trace, the decode pool fixed. Hand-computed on the round
profile: one prefill worker serves 10k prompt tokens/s."""

from __future__ import annotations

import pytest
from sim_fakes import make_profile, req

from cluster.planner.types import DECODE_POOL, PREFILL_POOL, PoolCounts
from cluster.simulator import SimConfig, simulate
from cluster.simulator.foresight import ForesightPolicy, rolling_token_rate

P, D = PREFILL_POOL, DECODE_POOL


def quiet_then_burst():
    """1k tokens/s for 100 s, then 45k tokens/s for 2 s (a burst at t = 100..101)."""
    reqs = [req(float(t), 1000, 2) for t in range(100)]
    reqs += [req(100.0 + i / 45, 1000, 2) for i in range(90)]
    return reqs


def test_the_rolling_rate_is_the_tokens_of_the_last_seconds():
    rate = rolling_token_rate([req(0.0, 600, 1), req(0.5, 400, 1), req(2.0, 300, 1)], 2)
    assert rate == [500.0, 500.0, 150.0, 150.0]


def test_the_pool_is_sized_for_the_peak_one_start_up_ahead():
    reqs = quiet_then_burst()
    policy = ForesightPolicy(
        reqs, make_profile(), decode=2, horizon_s=40.0, utilisation=0.9, smooth_s=1
    )
    assert policy.mu == pytest.approx(10_000)
    assert policy.initial() == {P: 1, D: 2}  # 1k tokens/s: one worker
    pools = PoolCounts(ready={P: 1, D: 2})
    # At t = 59 the burst (45k tokens/s) is within the horizon: ceil(45k / 9k) = 5.
    assert policy.decide(50.0, None, pools).desired == {P: 1, D: 2}
    assert policy.decide(61.0, None, pools).desired == {P: 5, D: 2}
    assert policy.decide(102.0, None, pools).desired == {P: 1, D: 2}  # it has passed
    capped = ForesightPolicy(reqs, make_profile(), decode=2, horizon_s=40.0, max_prefill=3)
    assert capped.decide(61.0, None, pools).desired[P] == 3


def test_simulated_it_meets_the_burst_that_a_pool_of_one_misses():
    reqs = quiet_then_burst()
    config = SimConfig(slo_ttft_s=1.0, slo_tpot_s=1.0, interval_s=10.0, startup_s=30.0)
    policy = ForesightPolicy(reqs, make_profile(), decode=2, horizon_s=40.0, smooth_s=1)
    seen = simulate(reqs, make_profile(), policy, config)
    assert seen.attainment == 1.0
    one = ForesightPolicy(reqs, make_profile(), decode=2, horizon_s=40.0, max_prefill=1)
    assert simulate(reqs, make_profile(), one, config).attainment < 0.9


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="needs the trace"):
        ForesightPolicy([], make_profile(), decode=1, horizon_s=10.0)
    with pytest.raises(ValueError, match="utilisation"):
        ForesightPolicy([req(0.0, 10, 1)], make_profile(), decode=1, horizon_s=10, utilisation=0)
