"""The cost of a prefill step of several chunks (bench/prefill_cost.py): attention
is per prompt, so k prompts in one step cost less than one prompt of as many tokens, a chunk
after earlier chunks of its prompt pays for reading them, and one fresh prompt costs exactly
the profile's curve. Hand-computed on a curve that is exactly a + b*n + q*n^2."""

from __future__ import annotations

from pytest import approx
from sim_fakes import FixedPolicy, make_profile, req

from bench.prefill_cost import PrefillCost, attention_coefficient
from cluster.simulator import SimConfig, simulate

A, B, Q = 0.005, 1e-4, 1e-7


def quadratic(n: int) -> float:
    return A + B * n + Q * n * n


def curved_profile(**overrides):
    points = [(n, quadratic(n)) for n in (16, 100, 150, 200, 250, 400, 600, 800, 1000)]
    return make_profile(prefill_points=points, **overrides)


def test_the_fit_finds_the_curve_s_attention_term():
    assert attention_coefficient(curved_profile()) == approx(Q, rel=1e-6)
    # A straight curve (the round-number profile of the other tests) has none.
    assert attention_coefficient(make_profile()) == 0.0
    straight = make_profile(prefill_points=[(100, 0.02), (500, 0.06), (1000, 0.11)])
    assert attention_coefficient(straight) == approx(0.0, abs=1e-15)


def test_one_fresh_prompt_costs_the_profile_s_curve():
    profile = curved_profile()
    cost = PrefillCost(profile)
    for n in (16, 300, 1000):
        assert cost.step_s([(n, 0)]) == approx(profile.prefill_s(n))


def test_prompts_sharing_a_step_pay_their_own_attention_only():
    cost = PrefillCost(curved_profile())
    # Four prompts of 250 tokens: the linear part of 1000 tokens, attention of four 250s.
    four = cost.step_s([(250, 0)] * 4)
    assert four == approx(A + B * 1000 + Q * 4 * 250**2)
    assert four < cost.step_s([(1000, 0)])


def test_a_later_chunk_reads_the_earlier_ones():
    cost = PrefillCost(curved_profile())
    # 200 new tokens after 800 of the same prompt: queries x (800 cached + 200 causal).
    assert cost.step_s([(200, 800)]) == approx(A + B * 200 + Q * (200**2 + 2 * 200 * 800))
    # The chunks of one prompt add up to more than the prompt in one step (a step each).
    whole = cost.step_s([(1000, 0)])
    assert cost.step_s([(800, 0)]) + cost.step_s([(200, 800)]) == approx(whole + A)


def test_a_mixed_step_adds_the_decode_step_without_its_fixed_part():
    profile = curved_profile()
    cost = PrefillCost(profile)
    decode = profile.decode_step_s(3, 600)
    expected = cost.step_s([(100, 0), (50, 0)]) + decode - profile.decode_fixed_s
    assert cost.mixed_step_s([(100, 0), (50, 0)], 3, 600) == approx(expected)
    assert cost.mixed_step_s([], 3, 600) == approx(decode)
    assert cost.mixed_step_s([(100, 0)], 0, 0) == approx(cost.step_s([(100, 0)]))


def test_the_simulated_prefill_worker_charges_a_shared_step_so():
    profile = curved_profile(max_batch_tokens=1000)
    reqs = [req(0.0, 400, 1), req(0.0, 600, 1)]
    r = simulate(reqs, profile, FixedPolicy(prefill=1, decode=1), SimConfig())
    # Both prompts fit one step: both first tokens at its end.
    shared = A + B * 1000 + Q * (400**2 + 600**2)
    assert r.ttft_s == [approx(shared), approx(shared)]
    assert shared < profile.prefill_s(1000)  # the old charge: one 1000-token prompt


def test_the_attention_part_is_the_fit_s_quadratic_term():
    cost = PrefillCost(curved_profile())
    assert cost.attention_s([(250, 0)] * 4) == approx(Q * 4 * 250**2)
    assert cost.attention_s([(200, 800)]) == approx(Q * (200**2 + 2 * 200 * 800))
    assert PrefillCost(make_profile()).attention_s([(500, 0)]) == 0.0


def test_beside_a_busy_peer_only_the_non_attention_part_slows_down():
    profile = curved_profile()
    reqs = [req(0.0, 100, 3000), req(0.5, 1000, 1)]  # r0 keeps the decode worker busy
    config = SimConfig(host_workers=2, disagg_threshold=200, prefill_corun_slowdown=0.5)
    r = simulate(reqs, profile, FixedPolicy(prefill=1, decode=1), config)
    attention = Q * 1000**2
    assert r.ttft_s[1] == approx(attention + (quadratic(1000) - attention) * 1.5)


def test_a_flat_start_is_left_out_of_the_fit():
    # A GPU-like curve: steps of up to 256 tokens take the weights' read time (flat), longer
    # ones their compute, b*n + q*n^2. Fitting the quadratic through the flat start would
    # put most of a long step in attention; past it the fit finds q.
    b, q, floor = 3e-5, 5e-10, 0.0069
    points = [(n, max(floor, b * n + q * n * n)) for n in (16, 32, 64, 128)]
    points += [(n, b * n + q * n * n) for n in (512, 1024, 2048, 4096, 8192)]
    profile = make_profile(prefill_points=points, max_batch_tokens=8192)
    assert attention_coefficient(profile) == approx(q, rel=1e-3)
    # Eight 1024-token prompts in one step cost their GEMMs (b per token) and their own
    # attention: the step is not priced below its compute.
    step = PrefillCost(profile).step_s([(1024, 0)] * 8)
    assert step == approx(b * 8192 + q * 8 * 1024**2, rel=1e-3)


def test_a_profile_that_knows_its_attention_term_is_not_fitted():
    profile = curved_profile(prefill_attention_s=3e-7)
    assert PrefillCost(profile).q == 3e-7
    assert PrefillCost(curved_profile()).q == approx(Q, rel=1e-6)


def test_a_prompt_s_work_is_its_tokens_at_a_full_step_s_rate_plus_its_attention():
    profile = curved_profile(max_batch_tokens=1000)
    cost = PrefillCost(profile)
    per_token = (profile.prefill_s(1000) - Q * 1000**2) / 1000
    assert cost.prompt_work_s(250) == approx(250 * per_token + Q * 250**2)
    assert cost.prompt_work_s(200, cached=800) == approx(
        200 * per_token + Q * (200**2 + 2 * 200 * 800)
    )
    # Four such prompts fill a step: their work adds up to the step's time.
    assert 4 * cost.prompt_work_s(250) == approx(cost.step_s([(250, 0)] * 4))
    assert cost.prompt_work_s(0) == 0.0
