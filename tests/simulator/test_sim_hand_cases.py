"""The simulator against small cases computed by hand from the profile's cost model
(sim_fakes.PROFILE: prefill 1e-4 s/token, decode step 0.01 + 0.001*batch + 1e-6*context,
transfer 0.005 + 1e-5 s/token, budget 1000 tokens)."""

from __future__ import annotations

import math

import pytest
from sim_fakes import FixedPolicy, decode_steps_s, make_profile, req

from cluster.simulator.run import SimConfig, simulate

approx = pytest.approx


def run(requests, policy, profile=None, **cfg):
    return simulate(requests, profile or make_profile(), policy, SimConfig(**cfg))


def test_one_request_prefill_transfer_decode_exactly():
    profile = make_profile(request_overhead_s=0.05, token_overhead_s=0.002)
    r = run([req(1.0, 500, 4)], FixedPolicy(prefill=1, decode=1), profile)
    first = 1.0 + 500 * 1e-4  # one prefill step of the whole prompt
    landed = first + 0.005 + 500 * 1e-5  # KV transfer of 500 tokens
    # 3 decode steps after the first token; context = prompt + tokens so far.
    finish = landed + decode_steps_s(profile, [501, 502, 503])
    assert r.ttft_s[0] == approx(first - 1.0 + 0.05)
    assert r.finish_s[0] == approx(finish)
    assert r.tpot_s[0] == approx((finish - first) / 3 + 0.002)
    assert r.end_s == approx(finish)
    assert r.placements == [(0, 1)]  # prefill worker 0, decode worker 1
    # Two workers, ready from t=0 to the end.
    assert r.gpu_hours == approx(2 * finish / 3600)
    assert r.finished == 1 and r.aborted is None


def test_a_one_token_request_ends_at_its_prefill_with_no_tpot():
    r = run([req(1.0, 500, 1)], FixedPolicy(prefill=1, decode=1))
    assert r.finish_s[0] == approx(1.05)
    assert math.isnan(r.tpot_s[0])
    assert r.attainment == 1.0


def test_a_queue_of_two_shares_the_token_budget():
    # 800 + 600 tokens exceed the 1000-token step: the second prompt's first 200 tokens ride
    # in the first step, the other 400 in a second step.
    r = run([req(0.0, 800, 1), req(0.0, 600, 1)], FixedPolicy(prefill=1, decode=1))
    assert r.ttft_s == [approx(0.1), approx(0.1 + 400 * 1e-4)]


def test_a_second_prompt_waits_for_the_step_in_flight():
    r = run([req(0.0, 800, 1), req(0.01, 600, 1)], FixedPolicy(prefill=1, decode=1))
    # The first step (800 tokens, 0.08 s) started alone; the second prompt starts after it.
    assert r.ttft_s == [approx(0.08), approx(0.08 + 0.06 - 0.01)]


def test_a_long_prompt_is_chunked_by_the_token_budget():
    profile = make_profile(prefill_points=[(100, 0.02), (1000, 0.1)])
    r = run([req(0.0, 2500, 1)], FixedPolicy(prefill=1, decode=1), profile)
    chunked = 2 * profile.prefill_s(1000) + profile.prefill_s(500)
    assert r.ttft_s[0] == approx(chunked)
    assert chunked != approx(profile.prefill_s(2500))  # the test would prove nothing


def test_a_full_decode_batch_makes_the_second_sequence_wait():
    profile = make_profile(max_num_seqs=1)
    r = run([req(0.0, 100, 3), req(0.0, 100, 3)], FixedPolicy(prefill=1, decode=1), profile)
    # One sequence a step on the prefill worker too: first tokens at 0.01 and 0.02.
    assert r.ttft_s == [approx(0.01), approx(0.02)]
    landed = 0.01 + 0.005 + 100 * 1e-5
    steps = decode_steps_s(profile, [101, 102])
    # The second landed at 0.026, while the first still decoded: it waits for its finish.
    assert 0.02 + 0.006 < landed + steps
    assert r.finish_s == [approx(landed + steps), approx(landed + 2 * steps)]


def test_kv_transfer_delays_decoding_not_the_first_token():
    slow = make_profile(transfer_latency_s=1.005)
    fast_r = run([req(0.0, 500, 5)], FixedPolicy(prefill=1, decode=1))
    slow_r = run([req(0.0, 500, 5)], FixedPolicy(prefill=1, decode=1), slow)
    assert slow_r.ttft_s[0] == approx(fast_r.ttft_s[0])
    assert slow_r.finish_s[0] - fast_r.finish_s[0] == approx(1.0)
    assert slow_r.tpot_s[0] - fast_r.tpot_s[0] == approx(1.0 / 4)


def test_short_prompts_are_prefilled_on_the_decode_worker_in_mixed_steps():
    profile = make_profile()
    reqs = [req(0.0, 100, 100), req(0.03, 150, 2), req(50.0, 300, 2)]
    r = run(reqs, FixedPolicy(prefill=1, decode=1), profile, disagg_threshold=200)
    assert [p[0] for p in r.placements] == [None, None, 0]  # local, local, remote
    # r0: a prefill-only step (empty batch), then decode steps reading 101, 102, ...
    first0 = profile.prefill_s(100)
    assert r.ttft_s[0] == approx(first0)
    # r1 arrives during r0's 2nd decode step; it joins after it, in a mixed step.
    step2_end = first0 + decode_steps_s(profile, [101, 102])
    assert 0.03 < step2_end
    mixed = profile.prefill_s(150) + decode_steps_s(profile, [103]) - profile.decode_fixed_s
    assert r.ttft_s[1] == approx(step2_end + mixed - 0.03)
    # Then both decode one step together (r1's last token), and r0 goes on alone.
    both = decode_steps_s(profile, [104 + 151], batch=2)
    assert r.finish_s[1] == approx(step2_end + mixed + both)
    # r0 needs 99 decode steps: 2 + the mixed one + 1 with r1 + 95 alone (contexts 105..199).
    alone = decode_steps_s(profile, list(range(105, 200)))
    assert r.finish_s[0] == approx(step2_end + mixed + both + alone)


def test_without_a_ready_prefill_worker_every_prompt_is_local():
    r = run([req(0.0, 5000, 1)], FixedPolicy(prefill=0, decode=1))
    assert r.placements == [(None, 0)]
    assert r.ttft_s[0] == approx(5 * 0.1)  # five 1000-token chunks on the decode worker


def test_a_colocated_replica_prefills_and_decodes():
    profile = make_profile()
    r = run([req(0.0, 300, 3)], FixedPolicy(colocated=1), profile)
    assert r.placements == [(None, 0)]
    assert r.finish_s[0] == approx(0.03 + decode_steps_s(profile, [301, 302]))
