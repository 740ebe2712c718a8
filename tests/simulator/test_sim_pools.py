"""Pools under a policy: scale-up after the start-up delay, drain, cancelled start-ups,
GPU-hours, the windows the policy is shown, attainment arithmetic and early stops."""

from __future__ import annotations

import math

import pytest
from sim_fakes import FixedPolicy, ScriptedPolicy, make_profile, req

from cluster.simulator.report import percentiles_ms, summarize
from cluster.simulator.run import SimConfig, SimResult, simulate

approx = pytest.approx


def test_a_new_worker_serves_only_from_the_end_of_its_start_up():
    policy = ScriptedPolicy({"prefill": 1, "decode": 1}, [(10.0, {"prefill": 1, "decode": 2})])
    reqs = [req(0.0, 100, 20_000), req(39.9, 100, 2), req(40.0, 100, 2)]
    r = simulate(reqs, make_profile(startup_s=30.0), policy, SimConfig(interval_s=10.0))
    new = r.workers[2]
    assert (new["pool"], new["asked_s"], new["ready_s"]) == ("decode", 10.0, 40.0)
    # Before t=40 only the old decode worker (id 1) exists; at 40 the new one is less loaded.
    assert [p[1] for p in r.placements] == [1, 1, 2]
    seen = {p_t: pools for p_t, pools in zip((10, 20, 30, 40), policy.pools, strict=False)}
    assert (seen[20].starting["decode"], seen[20].ready["decode"]) == (1, 1)
    assert (seen[40].starting["decode"], seen[40].ready["decode"]) == (0, 2)
    # GPU-hours count the new worker from its ask, not from its readiness.
    assert r.gpu_hours == approx((2 * r.end_s + (r.end_s - 10.0)) / 3600)
    assert ("decode", 1, 1) in [(p, rd, s) for t, p, rd, s, _ in r.timeline if t == 10.0]


def test_gpu_hours_count_each_pools_workers_at_its_tp_size():
    """Prefill workers of TP 4 and decode workers of TP 2: every worker-second is that many
    GPU-seconds, in the total and in the per-pool split of the report."""
    policy = FixedPolicy(prefill=1, decode=2)
    cfg = SimConfig(prefill_gpus_per_worker=4, decode_gpus_per_worker=2)
    r = simulate([req(0.0, 100, 50)], make_profile(), policy, cfg)
    assert r.gpu_hours == approx((4 + 2 * 2) * r.end_s / 3600)
    by_pool = summarize(r, {"prefill": 4, "decode": 2})["gpu_hours_by_pool"]
    assert by_pool == approx({"prefill": 4 * r.end_s / 3600, "decode": 4 * r.end_s / 3600})


def test_a_drained_worker_finishes_its_sequences_takes_no_new_ones_then_leaves():
    policy = ScriptedPolicy({"decode": 2}, [(10.0, {"decode": 1})])
    reqs = [
        req(0.0, 10, 3000),  # -> worker 0
        req(0.001, 10, 5000),  # -> worker 1 (empty)
        req(0.002, 10, 3000),  # -> worker 0 (less KV committed)
        req(11.0, 10, 10),  # after the drain
    ]
    r = simulate(reqs, make_profile(), policy, SimConfig(interval_s=10.0))
    assert [p[1] for p in r.placements] == [0, 1, 0, 0]
    w1 = r.workers[1]
    # Worker 1 (the least loaded) drained at t=10 and left when its sequence finished.
    assert w1["left_s"] == approx(r.finish_s[1])
    assert r.finish_s[1] > 10.0
    assert math.isnan(r.workers[0]["left_s"])
    assert r.gpu_hours == approx((r.end_s + w1["left_s"]) / 3600)
    draining = [(t, d) for t, p, _, _, d in r.timeline if p == "decode"]
    assert (10.0, 1) in draining and draining[-1] == (approx(r.finish_s[1]), 0)


def test_draining_a_starting_worker_cancels_it():
    script = [(10.0, {"decode": 2}), (20.0, {"decode": 1})]
    policy = ScriptedPolicy({"decode": 1}, script)
    r = simulate([req(0.0, 10, 2), req(25.0, 10, 2)], make_profile(startup_s=30.0), policy)
    cancelled = r.workers[1]
    assert (cancelled["asked_s"], cancelled["left_s"]) == (10.0, 20.0)
    assert math.isnan(cancelled["ready_s"])
    assert r.gpu_hours == approx((r.end_s + 10.0) / 3600)


def test_requests_wait_at_the_router_while_no_decode_worker_is_ready():
    policy = ScriptedPolicy({"decode": 0}, [(10.0, {"decode": 1})])
    r = simulate([req(1.0, 100, 1)], make_profile(startup_s=5.0), policy)
    assert r.ttft_s[0] == approx(15.0 + 0.01 - 1.0)  # ready at 15, then a 0.01 s prefill


def test_the_window_the_policy_sees():
    policy = ScriptedPolicy({"prefill": 1, "decode": 1}, [])
    reqs = [req(1.0, 50, 2), req(2.0, 500, 3), req(9.9, 5000, 2), req(25.0, 10, 2)]
    simulate(reqs, make_profile(), policy, SimConfig(interval_s=10.0, disagg_threshold=100))
    w = policy.windows[0]
    assert (w.start_s, w.duration_s, w.arrivals) == (0.0, 10.0, 3)
    assert (w.prompt_lengths.total, w.local_prefills, w.uncached_prompt_tokens) == (5550, 1, 5550)
    assert (w.finished, w.output_lengths.total) == (2, 5)
    assert (w.ttft.count, w.tpot.count) == (2, 2)
    # At t=10 the 5000-token prompt is still in its 0.5 s prefill.
    assert (w.queued_requests, w.queued_prompt_tokens, w.prefill_waiting) == (1, 5000, 1)
    assert (w.decode_running, w.decode_waiting, w.kv_usage) == (0, 0, 0.0)
    nxt = policy.windows[1]
    assert (nxt.arrivals, nxt.finished, nxt.ttft.count, nxt.queued_requests) == (0, 1, 1, 0)


def test_kv_usage_in_the_window_is_the_fullest_decode_worker():
    policy = ScriptedPolicy({"decode": 2}, [])
    reqs = [req(0.0, 1000, 30_000), req(0.0, 100, 30_000)]
    simulate(reqs, make_profile(kv_capacity_tokens=100_000), policy, SimConfig(interval_s=10.0))
    w = policy.windows[0]
    assert w.kv_usage == approx(31_000 / 100_000)
    assert w.decode_running == 2


def _result(ttft, tpot, outputs, **cfg) -> SimResult:
    return SimResult(
        policy="p",
        config=SimConfig(**cfg),
        ttft_s=ttft,
        tpot_s=tpot,
        output_lens=outputs,
        finish_s=[0.0] * len(ttft),
        finished=sum(not math.isnan(t) for t in tpot),
        end_s=3600.0,
        gpu_hours=2.0,
        wall_s=0.0,
    )


def test_attainment_needs_both_targets_and_counts_unfinished_as_missed():
    nan = math.nan
    r = _result(
        [0.5, 1.5, 0.5, nan, 0.5],
        [0.05, 0.05, 0.2, nan, nan],
        [10, 10, 10, 10, 1],
        slo_ttft_s=1.0,
        slo_tpot_s=0.1,
    )
    # ok; TTFT over; TPOT over; never finished; one token (no TPOT) within TTFT.
    assert (r.met, r.attainment) == (2, 0.4)
    s = summarize(r)
    assert (s["met"], s["attainment"], s["gpu_hours"]) == (2, 0.4, 2.0)


def test_percentiles_are_nearest_rank_in_ms_and_skip_missing():
    p = percentiles_ms([0.01 * i for i in range(1, 101)] + [math.nan])
    assert (p["count"], p["p50"], p["p90"], p["p99"]) == (100, approx(500), approx(900), 990)


def test_a_run_stops_once_more_requests_missed_than_allowed():
    reqs = [req(i * 0.01, 4000, 2) for i in range(200)]  # 400k prompt tokens/s: far too many
    cfg = SimConfig(slo_ttft_s=1.0, abort_after_misses=5)
    r = simulate(reqs, make_profile(), FixedPolicy(prefill=1, decode=1), cfg)
    assert r.aborted and "5" in r.aborted
    assert r.finished < len(reqs)
    assert r.attainment < 1.0


def test_progress_lines_go_to_stderr(capsys):
    reqs = [req(float(i), 100, 5) for i in range(100)]
    simulate(reqs, make_profile(), FixedPolicy(prefill=1, decode=1), SimConfig(progress=True))
    lines = capsys.readouterr().err.strip().splitlines()
    assert 8 <= len(lines) <= 11 and all(line.startswith("simulate: t=") for line in lines)
