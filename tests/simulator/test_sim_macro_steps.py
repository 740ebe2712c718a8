"""Decode runs advanced many steps per event give the same simulation as one event per step."""

from __future__ import annotations

import random

import pytest
from sim_fakes import ScriptedPolicy, make_profile

from cluster.simulator.decode_batch import decode_span_s, step_in_progress
from cluster.simulator.run import SimConfig, simulate
from cluster.simulator.traces import SimRequest

approx = pytest.approx


def test_the_series_and_its_inverse_agree_with_a_step_by_step_sum():
    profile = make_profile(decode_per_ctx_token_s=3e-6)
    batch, context, t = 5, 4000, 0.0
    ends = []
    for j in range(50):
        t += profile.decode_step_s(batch, context + j * batch)
        ends.append(t)
    assert decode_span_s(profile, batch, context, 50) == approx(ends[-1], rel=1e-12)
    for k in (1, 2, 17, 50):
        end = ends[k - 1]
        assert step_in_progress(profile, batch, context, end - 1e-9, 50) == k  # just before
        assert step_in_progress(profile, batch, context, end + 1e-9, 50) == min(k + 1, 50)
    assert step_in_progress(profile, batch, context, 1e9, 50) == 50


def _random_trace(seed: int, n: int) -> list[SimRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(4.0)
        prompt = rng.randint(20, 2500)
        shared = rng.randint(0, 3)
        # Blocks: a few shared system-prompt ids, then ids of this request alone.
        blocks = [100 + b for b in range(shared)] + [rng.randint(10**6, 10**9) for _ in range(4)]
        out.append(SimRequest(t, prompt, rng.randint(1, 300), tuple(blocks[: prompt // 512 + 1])))
    return out


def test_macro_steps_equal_one_event_per_decode_step():
    reqs = _random_trace(seed=7, n=120)
    # A small KV cache and few sequence slots, so sequences wait; scale-up, drain and a
    # start-up delay in the middle; short prompts prefilled locally in mixed steps.
    profile = make_profile(kv_capacity_tokens=6000, max_num_seqs=4, startup_s=3.0)
    script = [(5.0, {"prefill": 2, "decode": 3}), (15.0, {"prefill": 1, "decode": 1})]
    runs = []
    for step_by_step in (False, True):
        policy = ScriptedPolicy({"prefill": 1, "decode": 2}, script)
        cfg = SimConfig(interval_s=2.5, disagg_threshold=600, step_by_step=step_by_step)
        runs.append(simulate(reqs, profile, policy, cfg))
    macro, steps = runs
    assert macro.finished == steps.finished == len(reqs)
    assert macro.placements == steps.placements
    local = sum(p[0] is None for p in macro.placements)
    assert 0 < local < len(reqs)  # both paths ran
    for name in ("ttft_s", "finish_s"):
        assert getattr(macro, name) == approx(getattr(steps, name), rel=1e-9, abs=1e-9)
    assert macro.gpu_hours == approx(steps.gpu_hours, rel=1e-9)
    assert [d["desired"] for d in macro.decisions] == [d["desired"] for d in steps.decisions]
    assert [e[1:] for e in macro.timeline] == [e[1:] for e in steps.timeline]
    assert [e[0] for e in macro.timeline] == approx([e[0] for e in steps.timeline])
