"""The hindsight baselines find what an exhaustive search finds, with fewer simulations."""

from __future__ import annotations

import random

import pytest
from sim_fakes import FixedPolicy, make_profile

from cluster.simulator.run import SimConfig, simulate
from cluster.simulator.sweep import best_colocated, best_static
from cluster.simulator.traces import SimRequest

TARGET = 0.99


@pytest.fixture(scope="module")
def trace() -> list[SimRequest]:
    # About 12k prompt tokens/s for a minute: more than one prefill worker computes.
    rng, t, out = random.Random(3), 0.0, []
    while t < 60:
        t += rng.expovariate(6.0)
        out.append(SimRequest(t, rng.randint(1000, 3000), rng.randint(20, 120)))
    return out


CFG = SimConfig(slo_ttft_s=1.0, slo_tpot_s=0.05)


def _exhaustive(trace, sizes: list[dict[str, int]]):
    best = None
    for s in sizes:
        r = simulate(trace, make_profile(), FixedPolicy(**s), CFG)
        if r.attainment >= TARGET and (best is None or r.gpu_hours < best[1]):
            best = (s, r.gpu_hours)
    return best


def test_best_static_is_the_exhaustive_minimum(trace):
    grid = [{"prefill": p, "decode": d} for p in range(4) for d in range(1, 5)]
    want, want_hours = _exhaustive(trace, grid)
    sweep = best_static(
        trace,
        make_profile(),
        CFG,
        lambda p, d: FixedPolicy(prefill=p, decode=d),
        prefill_counts=range(4),
        decode_counts=(1, 4),
        target=TARGET,
    )
    assert (sweep.best.prefill, sweep.best.decode) == (want["prefill"], want["decode"])
    assert sweep.best.gpu_hours == pytest.approx(want_hours)
    assert sweep.best_result.attainment >= TARGET and sweep.best_result.aborted is None
    assert len(sweep.points) < len(grid)
    # Probes that could not reach the target stopped early, and say so.
    assert any(p.aborted for p in sweep.points if not p.meets)
    assert sweep.to_dict()["best"]["decode"] == want["decode"]


def test_the_gpu_budget_bounds_the_static_sweep(trace):
    sweep = best_static(
        trace,
        make_profile(gpus_per_worker=2),
        CFG,
        lambda p, d: FixedPolicy(prefill=p, decode=d),
        prefill_counts=range(4),
        decode_counts=(1, 4),
        target=TARGET,
        gpu_budget=6,
    )
    assert all(2 * (p.prefill + p.decode) <= 6 for p in sweep.points)


def test_best_colocated_is_the_fewest_replicas_meeting_the_target(trace):
    want, _ = _exhaustive(trace, [{"colocated": k} for k in range(1, 7)])
    sweep = best_colocated(
        trace,
        make_profile(),
        CFG,
        lambda k: FixedPolicy(colocated=k),
        replica_counts=(1, 6),
        target=TARGET,
    )
    assert sweep.best.decode == want["colocated"]
    assert len(sweep.points) < 6


def test_no_split_reaching_the_target_gives_no_best(trace):
    sweep = best_static(
        trace,
        make_profile(),
        CFG,
        lambda p, d: FixedPolicy(prefill=p, decode=d),
        prefill_counts=[1],
        decode_counts=(1, 2),
        target=TARGET,
    )
    assert sweep.best is None and sweep.best_result is None
    with pytest.raises(ValueError, match="target"):
        best_colocated(trace, make_profile(), CFG, FixedPolicy, replica_counts=(1, 2), target=0)
