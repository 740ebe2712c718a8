"""Length-aware TTFT targets in the simulator's attainment, the gzip / BurstGPT / committed
trace readers, and the oscillation count (`report.direction_changes`) under constant load."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest
from sim_fakes import FixedPolicy, ScriptedPolicy, make_profile, req

from bench.capacity_profile import CapacityProfile
from cluster.planner import make_policy
from cluster.planner.config import PlannerConfig
from cluster.simulator.report import direction_changes
from cluster.simulator.run import SimConfig, simulate
from cluster.simulator.traces import SimRequest, detect_format, load_requests

ROOT = Path(__file__).resolve().parents[2]
H100 = ROOT / "benchmarks/results/profile-llama3-8b-h100.json"


def test_a_per_1k_allowance_lets_a_long_prompt_meet_its_target():
    reqs = [req(0.0, 100, 2), req(30.0, 8000, 2)]
    tight = simulate(reqs, make_profile(), FixedPolicy(prefill=1, decode=1), SimConfig())
    ttfts = tight.ttft_s
    assert ttfts[1] > ttfts[0]
    # A base just above the short prompt's TTFT: only the long prompt misses...
    base = (ttfts[0] + 1e-6) * 1000
    cfg = SimConfig(slo_ttft_s=base / 1000, slo_tpot_s=10.0)
    r = simulate(reqs, make_profile(), FixedPolicy(prefill=1, decode=1), cfg)
    assert r.met == 1
    # Counted by the router's labels (engine.slo.SLO_RESULTS), as `tandem_slo_requests` is.
    assert r.slo_results() == {"met": 1, "missed_ttft": 1, "missed_tpot": 0, "missed_both": 0}
    no_tpot = SimConfig(slo_ttft_s=base / 1000, slo_tpot_s=1e-9)  # 2-token answers: miss
    assert simulate(
        reqs, make_profile(), FixedPolicy(prefill=1, decode=1), no_tpot
    ).slo_results() == {"met": 0, "missed_ttft": 0, "missed_tpot": 1, "missed_both": 1}
    # ...and with an allowance per 1k tokens that covers its extra time, both meet.
    per_1k = (ttfts[1] - ttfts[0]) / 8.0 + 1e-3
    cfg = SimConfig(slo_ttft_s=base / 1000, slo_tpot_s=10.0, slo_ttft_per_1k_s=per_1k)
    r = simulate(reqs, make_profile(), FixedPolicy(prefill=1, decode=1), cfg)
    assert r.met == 2 and r.attainment == 1.0
    assert cfg.ttft_target_s(8000) == pytest.approx(base / 1000 + 8 * per_1k)
    with pytest.raises(ValueError, match="slo_ttft_per_1k_s"):
        SimConfig(slo_ttft_per_1k_s=-0.1)


def test_gzip_and_burstgpt_traces_are_read(tmp_path):
    rows = [{"timestamp": 1500, "input_length": 700, "output_length": 3, "hash_ids": [1, 2]}]
    gz = tmp_path / "t.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    assert detect_format(gz) == "mooncake"
    assert load_requests(gz) == [SimRequest(0.0, 700, 3, (1, 2))]
    burst = tmp_path / "burst.csv"
    burst.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5.5,ChatGPT,300,0,300,Conversation log\n"
        "2.0,GPT-4,100,20,120,API log\n"
    )
    assert detect_format(burst) == "burstgpt"
    assert load_requests(burst) == [SimRequest(0.0, 100, 20), SimRequest(3.5, 300, 1)]
    burst.write_text("Timestamp,Model,Request tokens,Response tokens\n1.0,x,oops,2\n")
    with pytest.raises(ValueError, match="burst.csv:2"):
        load_requests(burst)
    burst.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="missing BurstGPT"):
        load_requests(burst, "burstgpt")


def test_the_committed_mooncake_slices_load_with_their_block_ids():
    for name, count in (("mooncake_conversation_20min", 3658), ("mooncake_synthetic", 3993)):
        reqs = load_requests(ROOT / f"benchmarks/traces/{name}.jsonl.gz")
        assert len(reqs) == count and all(r.hash_ids for r in reqs)


def test_direction_changes_counts_turns_and_the_most_in_ten_minutes():
    script = [(10.0, {"prefill": 2, "decode": 1}), (20.0, {"prefill": 1, "decode": 1})]
    script += [(700.0, {"prefill": 2, "decode": 1}), (710.0, {"prefill": 3, "decode": 1})]
    policy = ScriptedPolicy({"prefill": 1, "decode": 1}, script)
    reqs = [req(float(t), 100, 2) for t in range(0, 800, 5)]
    r = simulate(reqs, make_profile(startup_s=0.0), policy, SimConfig(interval_s=10.0))
    turns = direction_changes(r)
    # up, down (turn at 20), up (turn at 700), up: two turns, 680 s apart.
    assert turns["prefill"] == 2 and turns["prefill_max_per_10min"] == 1
    assert turns["decode"] == 0


@pytest.mark.parametrize("ttft_ms", [1000.0, 30000.0])
def test_no_pool_turns_more_than_once_in_ten_minutes_under_constant_load(ttft_ms):
    """A stationary Poisson load for 40 minutes (after a warm-up): no pool of the planner
    changes direction more than once in any 10 minutes (Dynamo's 2<->1 flapping, #9294)."""
    rng = random.Random(7)
    t, reqs = 0.0, []
    while t < 2400:
        t += rng.expovariate(4.0)
        reqs.append(SimRequest(t, rng.choice((2000, 6000, 12000)), rng.choice((100, 300))))
    profile = CapacityProfile.load(H100)
    cfg = PlannerConfig(slo_ttft_ms=ttft_ms, slo_tpot_ms=100, startup_s=60, max_prefill=32)
    r = simulate(reqs, profile, make_policy("planner", profile, cfg), SimConfig.for_planner(cfg))
    turns = direction_changes(r)
    assert turns["prefill_max_per_10min"] <= 1 and turns["decode_max_per_10min"] <= 1, turns
    assert r.attainment > 0.9
