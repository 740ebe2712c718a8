"""The sizing math against numbers worked by hand on the round profile (planner_fakes):
prefill 20k tokens/s linear, decode step = 10 ms + 0.1 ms/seq + 0.1 us/context token."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from planner_fakes import round_profile

from cluster.planner.demand import LengthDist, Workload
from cluster.planner.plans import Bounds, plan_disaggregated, plan_local, plan_pools
from cluster.planner.sizing import (
    Corrections,
    Targets,
    decode_load,
    erlang_c,
    kv_batch,
    mix_service,
    prefill_load,
    prefill_ttft_p90,
    size_decode,
    size_prefill,
    step_goal,
    wait_p90,
)

PROFILE = round_profile()
TARGETS = Targets(slo_ttft_s=1.0, slo_tpot_s=0.05, headroom=0.1)
WIDE = Bounds(0, 16, 1, 16)


def load(rate, prompt=1000, output=100, **queues) -> Workload:
    return Workload(rate, LengthDist.single(prompt), LengthDist.single(output), **queues)


def test_erlang_c_and_the_wait_tail():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    # C(2, 1.5) = (a^2/2)/(1-rho) / (1 + a + (a^2/2)/(1-rho)) = 4.5 / 7
    assert erlang_c(2, 1.5) == pytest.approx(4.5 / 7)
    assert erlang_c(3, 3.0) == 1.0 and erlang_c(4, 0.0) == 0.0
    # M/M/1 at rho 0.5, E[S] 1 s: P(W > t) = 0.5 exp(-0.5 t) -> p90 = ln(5) / 0.5.
    assert wait_p90(1, 0.5, 1.0, 1.0) == pytest.approx(math.log(5) / 0.5)
    assert wait_p90(4, 0.2, 1.0, 1.0) == 0.0  # fewer than 10% wait
    assert wait_p90(2, 2.0, 1.0, 1.0) == math.inf


def test_prefill_ttft_by_hand():
    pl = prefill_load(PROFILE, load(10.0), TARGETS)
    assert (pl.rate, pl.tokens_per_s, pl.mu) == (10.0, 10_000.0, 20_000.0)
    assert pl.mean_service_s == pytest.approx(0.05) and pl.service_scv == pytest.approx(0)
    # One worker: a = 0.5, C = 0.5, theta = 0.05 * (1 + 0) / 2 / 0.5 = 0.05,
    # wait p90 = 0.05 ln 5; then the p90 prompt's own 1000 tokens (0.05 s).
    expected = 0.05 * math.log(5) + 1000 / 20_000
    assert prefill_ttft_p90(PROFILE, pl, 1, TARGETS) == pytest.approx(expected)
    slower = prefill_load(PROFILE, load(10.0), TARGETS, correction=2.0)
    assert slower.mu == 10_000.0 and pl.corrected(2.0) == slower
    assert prefill_ttft_p90(PROFILE, slower, 1, TARGETS) > expected


def test_size_prefill_picks_the_least_workers_meeting_ttft():
    pl = prefill_load(PROFILE, load(30.0), TARGETS)
    plan = size_prefill(PROFILE, pl, TARGETS, 1, 16)
    # 30k tok/s needs >= 30k / (20k * 0.9) = 1.67 workers by throughput; at 2: a = 1.5,
    # C = 4.5/7, theta = 0.05 * 0.5 / 0.5, then 0.05 s of its own.
    expected = 0.05 * math.log(4.5 / 7 / 0.1) + 0.05
    assert plan.workers == 2 and plan.cause == "demand" and plan.met
    assert plan.ttft_p90_s == pytest.approx(expected)


def test_backlog_must_drain_within_the_target():
    pl = prefill_load(PROFILE, load(10.0, queued_prompt_tokens=200_000), TARGETS)
    # Tolerated: 10k tok/s * 0.9 s = 9k; the excess 191k drains within 1 s on top of 10k tok/s.
    assert pl.backlog_tokens == pytest.approx(191_000)
    plan = size_prefill(PROFILE, pl, TARGETS, 1, 16)
    assert plan.workers == math.ceil((10_000 + 191_000 / 1.0) / 20_000) == 11
    assert plan.cause == "backlog"
    capped = size_prefill(PROFILE, pl, TARGETS, 1, 4)
    assert capped.workers == 4 and not capped.met and capped.cause == "bounds"


def test_cached_prompt_tokens_are_not_prefilled():
    full = prefill_load(PROFILE, load(30.0), TARGETS)
    cached = prefill_load(PROFILE, Workload(30.0, *full_lengths(), uncached=0.25), TARGETS)
    assert cached.tokens_per_s == pytest.approx(full.tokens_per_s / 4)
    assert size_prefill(PROFILE, cached, TARGETS, 1, 16).workers == 1


def full_lengths():
    return LengthDist.single(1000), LengthDist.single(100)


def test_a_prompt_too_long_for_the_target_is_sized_for_throughput():
    pl = prefill_load(PROFILE, load(1.0, prompt=40_000), TARGETS)  # 2 s of compute alone
    plan = size_prefill(PROFILE, pl, TARGETS, 1, 16)
    assert not plan.met and "alone" in plan.note and plan.cause == "demand"
    assert plan.workers == math.ceil(40_000 / (20_000 * 0.9)) == 3


# A 100-token answer after a 1000-token prompt: its first decode token waits for the KV
# (1 ms + 1000 x 1000 B / 1 GB/s = 2 ms) and half a step for a step boundary, spread over
# 99 gaps, so its step may take (45 ms - 2 ms / 99) / (1 + 0.5 / 99).
STEP_100 = (0.045 - 0.002 / 99) / (1 + 0.5 / 99)
B_100 = math.floor((STEP_100 - 0.01) / 2.05e-4)  # 169 sequences at 1050 context tokens


def test_decode_by_hand():
    dl = decode_load(PROFILE, load(80.0), TARGETS, Corrections(), None, 0.0)
    # Context per running sequence: 1000 + E[o^2] / (2 E[o]) = 1000 + 100 / 2.
    assert dl.context == pytest.approx(1050)
    assert dl.step_goal_s == pytest.approx(STEP_100)
    plan = size_decode(PROFILE, dl, TARGETS, 1, 16)
    # 169 / (0.01 + 169 * 2.05e-4) = 3790 tok/s per worker; 80 req/s * 100 tokens -> 3.
    assert plan.batch == B_100 == 169
    assert plan.tokens_per_s_per_worker == pytest.approx(B_100 / (0.01 + B_100 * 2.05e-4))
    assert plan.workers == 3 and plan.met and plan.tpot_p50_s <= 0.045


def test_short_answers_set_the_step_unless_they_are_the_tail():
    # 5% of answers have 3 tokens: their first gap (KV 2 ms + half a step) is spread over
    # only 2 gaps, so the step must fit (45 ms - 1 ms) / 1.25; as the tail (the default 5%)
    # they are let go.
    outputs = LengthDist(((0.05, 3, 0), (0.95, 200, 0)))
    wl = Workload(10.0, LengthDist.single(1000), outputs)
    strict = Targets(1.0, 0.05, 0.1, tpot_tail_share=0.01)
    assert step_goal(PROFILE, wl, strict) == pytest.approx((0.045 - 0.002 / 2) / 1.25)
    lenient = TARGETS
    assert step_goal(PROFILE, wl, lenient) == pytest.approx((0.045 - 0.002 / 199) / (1 + 0.5 / 199))
    # Answers of one token have no TPOT; prompts prefilled locally have no KV hand-off.
    assert step_goal(PROFILE, load(1.0, output=1), TARGETS) == pytest.approx(0.045)
    assert step_goal(PROFILE, load(1.0), TARGETS, 0.0) == pytest.approx(0.045 / (1 + 0.5 / 99))


def test_short_answers_pay_their_own_prompts_hand_off():
    # 10% of the prompts are 200k tokens (a 0.2 s hand-off), 90% are 1k (2 ms); 20% of the
    # answers are 5 tokens. Lengths are independent: the 5-token answers to long prompts
    # would miss even alone (let go), those to short prompts (18%) set the step with their
    # own 2 ms hand-off, not the mean prompt's 22 ms.
    prompts = LengthDist(((0.9, 1000, 0), (0.1, 200_000, 0)))
    outputs = LengthDist(((0.2, 5, 0), (0.8, 200, 0)))
    wl = Workload(10.0, prompts, outputs)
    assert step_goal(PROFILE, wl, TARGETS) == pytest.approx((0.045 - 0.002 / 4) / 1.125)
    # Prompts below the disaggregation threshold are prefilled on decode: no hand-off.
    local = Targets(1.0, 0.05, 0.1, disagg_threshold=2000)
    assert step_goal(PROFILE, wl, local) == pytest.approx(0.045 / 1.125)


def test_long_answers_weigh_more_in_the_context():
    mixed = Workload(10.0, LengthDist.single(1000), LengthDist(((0.5, 10, 0), (0.5, 1000, 0))))
    dl = decode_load(PROFILE, mixed, TARGETS, Corrections(), None, 0.0)
    # E[o] = 505, E[o^2] = 500050: a running sequence is mostly a long answer.
    assert dl.context == pytest.approx(1000 + 500_050 / (2 * 505))


def test_kv_capacity_limits_the_batch():
    small_kv = round_profile(kv_capacity_tokens=50_000)
    dl = decode_load(small_kv, load(80.0), TARGETS, Corrections(), None, 0.0)
    plan = size_decode(small_kv, dl, TARGETS, 1, 16)
    assert plan.batch == 47  # 50000 / 1050 tokens per sequence
    assert plan.workers == math.ceil(8000 / (47 / (0.01 + 47 * 2.05e-4))) == 4


def test_kv_room_for_the_fluctuation_of_what_a_batch_holds():
    # Sequences of 1,050 tokens each (single lengths: E[c^2] = c^2); with z SDs kept free,
    # the batch b solves b*c + z*sqrt(b)*c = capacity.
    assert kv_batch(50_000, 1050, 1050**2, 0.0) == pytest.approx(50_000 / 1050)
    b = kv_batch(50_000, 1050, 1050**2, 2.0)
    assert b * 1050 + 2 * math.sqrt(b) * 1050 == pytest.approx(50_000)
    assert 33 < b < 50_000 / 1050
    # Varying contexts (a larger second moment at the same mean) need more room.
    assert kv_batch(50_000, 1050, 3 * 1050**2, 2.0) < b
    # The planner's own Targets keep none: the warm start's do (policy.WARM_KV_SIGMAS).
    small_kv = round_profile(kv_capacity_tokens=50_000)
    wl = load(90.0)  # 9k tokens/s: 4 workers at the mean batch (47), 5 with room (35)
    roomy = replace(TARGETS, kv_sigmas=2.0)
    assert (
        TARGETS.kv_sigmas == 0
        and decode_load(small_kv, wl, TARGETS, Corrections(), None, 0).kv_sigmas == 0
    )
    kept = size_decode(
        small_kv, decode_load(small_kv, wl, roomy, Corrections(), None, 0), roomy, 1, 16
    )
    at_mean = size_decode(
        small_kv, decode_load(small_kv, wl, TARGETS, Corrections(), None, 0), TARGETS, 1, 16
    )
    assert (at_mean.batch, at_mean.workers) == (47, 4)
    assert (kept.batch, kept.workers) == (math.floor(b), 5)


def test_the_context_second_moment_counts_prompts_and_ages():
    mixed = Workload(10.0, LengthDist(((0.5, 500, 0), (0.5, 1500, 0))), LengthDist.single(100))
    dl = decode_load(PROFILE, mixed, TARGETS, Corrections(), None, 0.0)
    # E[p^2] = 1.25e6, E[age] = 50, E[age^2] = 100^2 / 3: prompt and age independent.
    assert dl.context == pytest.approx(1000 + 50)
    assert dl.context_sq == pytest.approx(1.25e6 + 2 * 1000 * 50 + 100**2 / 3)


def test_sequences_in_flight_need_slots():
    dl = decode_load(PROFILE, load(1.0, decode_running=600, decode_waiting=400), TARGETS,
                     Corrections(), None, 0.0)  # fmt: skip
    plan = size_decode(PROFILE, dl, TARGETS, 1, 16)
    assert plan.workers == math.ceil(1000 / B_100) == 6 and plan.cause == "backlog"


def test_local_prefills_take_decode_time():
    # Every prompt below the threshold: each 1000-token prefill adds 0.05 - 0.01 s to a step.
    t = Targets(1.0, 0.05, 0.1, disagg_threshold=2000)
    wl = load(10.0)
    share, _, local = wl.prompts.split(2000)
    dl = decode_load(PROFILE, wl, t, Corrections(), local, 1 - share)
    assert dl.local_rate == 10.0 and dl.local_work == pytest.approx(0.4)
    plan = size_decode(PROFILE, dl, t, 1, 16)
    # One worker busy 40% prefilling (and no KV hand-off): its steps stretch by 1 / 0.6.
    step = 0.045 / (1 + 0.5 / 99)
    assert plan.workers == 1 and plan.batch == math.floor((step * 0.6 - 0.01) / 2.05e-4) == 82
    without = size_decode(PROFILE, decode_load(PROFILE, wl, t, Corrections(), None, 0), t, 1, 16)
    assert without.batch == B_100


def test_unmeetable_tpot_sizes_for_throughput_and_says_so():
    # No pool size meets a TPOT below one sequence's step: more workers buy nothing, so the
    # pool carries the demand at the batch the KV cache holds instead of jumping to its max
    # (issue 26: 32 decode workers for 425 output tok/s of 190k-token sequences).
    t = Targets(1.0, 0.005, 0.1)  # below the 10 ms fixed step
    dl = decode_load(PROFILE, load(10.0), t, Corrections(), None, 0.0)
    plan = size_decode(PROFILE, dl, t, 1, 5)
    assert not plan.met and "TPOT" in plan.note and plan.cause == "bounds"
    assert plan.workers < 5 and plan.batch >= 1
    assert plan.workers * plan.tokens_per_s_per_worker >= dl.tokens_per_s


def test_a_tiny_prompt_load_is_prefilled_on_decode_workers():
    plan = plan_pools(PROFILE, load(1.0, prompt=100), TARGETS, Corrections(), WIDE)
    assert plan.local_only and plan.prefill.workers == 0 and plan.decode.workers == 1
    assert plan.met and plan.ttft_p90_s <= 0.9


def test_conditional_disaggregation_takes_the_cheaper_mode_that_meets_both_targets():
    # 2000-token prompts at 10/s: a prefill pool (2) + decode (1) against 2 decode workers
    # that prefill everything themselves: the local mode saves a GPU.
    wl = load(10.0, prompt=2000)
    split = plan_disaggregated(PROFILE, wl, TARGETS, Corrections(), WIDE)
    local = plan_local(PROFILE, wl, TARGETS, Corrections(), WIDE)
    assert (split.prefill.workers, split.decode.workers, local.decode.workers) == (2, 1, 2)
    chosen = plan_pools(PROFILE, wl, TARGETS, Corrections(), WIDE)
    assert chosen.local_only and chosen.workers == 2
    # With min_prefill >= 1 the local mode is never taken.
    assert not plan_pools(PROFILE, wl, TARGETS, Corrections(), Bounds(1, 16, 1, 16)).local_only


def test_long_prompts_that_would_stall_decoding_get_a_prefill_pool():
    tight = Targets(1.0, 0.025, 0.1)  # 22.5 ms; an 8000-token prefill takes 0.39 s of a step
    wl = load(10.0, prompt=8000)
    local = plan_local(PROFILE, wl, tight, Corrections(), WIDE)
    # Each decode worker loses 3.9 s/s / D to prefills, so each holds a batch of a few.
    assert local.met and local.decode.batch <= 4
    chosen = plan_pools(PROFILE, wl, tight, Corrections(), WIDE, prefer_local=True)
    assert not chosen.local_only and chosen.met and chosen.workers < local.workers
    # 80k tok/s over 20k * 0.9 per worker -> at least 5; decode batch 13 at 8050 context.
    assert chosen.prefill.workers >= 5 and chosen.decode.batch == 13


def test_a_tie_keeps_the_current_mode():
    wl = load(30.0)  # 2 + 1 split or 3 local
    assert not plan_pools(PROFILE, wl, TARGETS, Corrections(), WIDE).local_only
    assert plan_pools(PROFILE, wl, TARGETS, Corrections(), WIDE, prefer_local=True).local_only


def test_a_worker_s_throughput_follows_the_prompt_mix():
    # A curve with an attention term (q n^2): one 10k-token prompt per step is slower per
    # token than ten 1k-token prompts sharing the step, as the simulator charges them.
    a, b, q = 0.005, 4e-5, 1e-9
    curve = [(n, a + b * n + q * n * n) for n in (100, 1000, 2500, 5000, 10_000)]
    profile = round_profile(prefill_points=curve)
    per_token = (profile.prefill_s(10_000) - q * 1e8) / 10_000
    short, times = mix_service(profile, LengthDist.single(1000))
    assert short == pytest.approx(1000 / (1000 * per_token + q * 1000**2))
    assert times == [(1.0, pytest.approx(1000 / short))]
    full, _ = mix_service(profile, LengthDist.single(10_000))
    assert full == pytest.approx(profile.prefill_tokens_per_s()) and short > 1.2 * full
    # Slower workers (correction 2) serve half as fast; a linear curve gives the full-step rate.
    assert mix_service(profile, LengthDist.single(1000), correction=2.0)[0] == pytest.approx(
        short / 2
    )
    assert mix_service(PROFILE, LengthDist.single(1000))[0] == pytest.approx(20_000)
    # The prefill pool is sized with it.
    pl = prefill_load(
        profile, Workload(10.0, LengthDist.single(1000), LengthDist.single(100)), TARGETS
    )
    assert pl.mu == pytest.approx(short) and pl.mean_service_s == pytest.approx(1000 / short)
