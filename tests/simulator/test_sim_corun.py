"""Workers that share a machine slow each other down (SimConfig.host_workers and the co-run
slowdowns; workers.py): a prefill step runs slower while the decode worker computes and is
re-timed when it stops, decode steps run slower while the prefill worker computes, and
workers on machines of their own (the default) do not interact. Hand-computed on the
round-number profile of sim_fakes (a straight prefill curve: the whole step slows)."""

from __future__ import annotations

from pytest import approx
from sim_fakes import FixedPolicy, decode_steps_s, make_profile, req

from cluster.planner.types import DECODE_POOL, PREFILL_POOL
from cluster.simulator.cluster_model import SimCluster
from cluster.simulator.events import EventQueue
from cluster.simulator.run import SimConfig, simulate
from cluster.simulator.window import WindowRecorder

SHARED = dict(host_workers=2, disagg_threshold=200)


def run(requests, **cfg):
    return simulate(requests, make_profile(), FixedPolicy(prefill=1, decode=1), SimConfig(**cfg))


def test_a_prefill_beside_a_busy_decode_worker_is_slower():
    # r0 decodes for seconds on the decode worker; r1's 1000-token prompt (0.1 s) comes later.
    reqs = [req(0.0, 100, 1000), req(0.5, 1000, 1)]
    alone = run(reqs, disagg_threshold=200)
    shared = run(reqs, prefill_corun_slowdown=0.5, **SHARED)
    assert alone.ttft_s[1] == approx(0.1)
    assert shared.ttft_s[1] == approx(0.15)
    # On machines of their own, the slowdown is never applied.
    assert run(reqs, prefill_corun_slowdown=0.5, disagg_threshold=200).ttft_s == alone.ttft_s


def test_a_prefill_step_speeds_up_when_its_peer_stops():
    # r0 (local) keeps the decode worker busy until its last token at t_d; r1's prefill runs
    # at 2/3 speed until then, at full speed after.
    profile = make_profile()
    reqs = [req(0.0, 100, 3), req(0.0, 1000, 1)]
    shared = run(reqs, prefill_corun_slowdown=0.5, **SHARED)
    t_d = 100 * 1e-4 + decode_steps_s(profile, [101, 102])
    assert shared.finish_s[0] == approx(t_d)
    assert shared.ttft_s[1] == approx(t_d + (0.1 - t_d / 1.5))


def test_decode_steps_beside_a_busy_prefill_worker_are_slower_and_macro_runs_agree():
    # r0 decodes 400 tokens alone; r1's prompt keeps the prefill worker busy for 0.1 s.
    reqs = [req(0.0, 100, 400), req(0.5, 1000, 1)]
    alone = run(reqs, disagg_threshold=200)
    shared = run(reqs, decode_corun_slowdown=1.0, **SHARED)
    stepwise = run(reqs, decode_corun_slowdown=1.0, step_by_step=True, **SHARED)
    assert shared.finish_s == approx(stepwise.finish_s, rel=1e-12)
    # 0.1 s at half speed: 0.05 s of decoding later, give or take the step that was running
    # when the prefill started (it keeps its rate) and the one running when it stopped.
    step = decode_steps_s(make_profile(), [600])
    delay = shared.finish_s[0] - alone.finish_s[0]
    assert 0.05 - step < delay < 0.05 + 2 * step
    assert shared.ttft_s[1] == approx(alone.ttft_s[1])  # no prefill slowdown asked for


def test_workers_fill_machines_in_the_order_they_are_asked_for():
    profile = make_profile()
    cluster = SimCluster(
        profile, queue=EventQueue(), recorder=WindowRecorder(0.0), disagg_threshold=0,
        startup_s=0.0, slo_ttft_s=1.0, slo_tpot_s=1.0, host_workers=2,
        corun_slowdown={PREFILL_POOL: 0.3, DECODE_POOL: 0.2},
    )  # fmt: skip
    workers = [cluster.add_worker(pool, 0.0) for pool in (PREFILL_POOL, DECODE_POOL) * 2]
    assert [[p.wid for p in w.peers] for w in workers] == [[1], [0], [3], [2]]
    assert [w.corun_slowdown for w in workers] == [0.3, 0.2, 0.3, 0.2]


def test_the_config_rejects_bad_machine_settings():
    import pytest

    with pytest.raises(ValueError, match="host_workers"):
        SimConfig(host_workers=0)
    with pytest.raises(ValueError, match="decode_corun_slowdown"):
        SimConfig(decode_corun_slowdown=-0.1)
