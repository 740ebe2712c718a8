"""The fits that build a measured capacity profile, and the idle-request timeline that both
`tandem profile --capacity --live` and `tandem plan` read, against hand-computed numbers."""

from __future__ import annotations

import random

import pytest

from bench.capacity_model import decode_steps_s, fit_decode, fit_line, idle_request, nnls
from bench.capacity_profile import CapacityProfile


def test_nnls_is_exact_on_consistent_data_and_never_negative():
    rows = [[1, x, x * x] for x in range(1, 8)]
    assert nnls(rows, [2 + 3 * x + 0.5 * x * x for x in range(1, 8)]) == pytest.approx([2, 3, 0.5])
    # y = 5 - x: unconstrained the slope is -1; non-negative it is 0 and the intercept the mean.
    intercept, slope = nnls([[1, x] for x in range(5)], [5 - x for x in range(5)])
    assert slope == 0 and intercept == pytest.approx(3.0)


def test_decode_fit_recovers_known_coefficients():
    fixed, per_seq, per_ctx = 4e-3, 0.15e-3, 0.02e-6
    samples = [
        (b, b * c, fixed + per_seq * b + per_ctx * b * c)
        for b in (1, 2, 4, 8, 16, 32, 64)
        for c in (16, 256, 1024, 1700)
    ]
    fit = fit_decode(samples)
    assert (fit.fixed_s, fit.per_seq_s, fit.per_ctx_token_s) == pytest.approx(
        (fixed, per_seq, per_ctx), rel=1e-6
    )
    assert fit.rel_err_max < 1e-9


def test_decode_fit_under_noise_stays_close_and_reports_its_error():
    rng = random.Random(7)
    fixed, per_seq, per_ctx = 5e-3, 0.2e-3, 0.05e-6
    samples = []
    for b in (1, 2, 4, 8, 16, 32, 64):
        for c in (16, 256, 512, 1024, 1700):
            true = fixed + per_seq * b + per_ctx * b * c
            samples.append((b, b * c, true * (1 + rng.uniform(-0.03, 0.03))))
    fit = fit_decode(samples)
    assert fit.fixed_s == pytest.approx(fixed, rel=0.05)
    assert fit.per_seq_s == pytest.approx(per_seq, rel=0.1)
    assert fit.per_ctx_token_s == pytest.approx(per_ctx, rel=0.1)
    assert 0 < fit.rel_err_mean < 0.03 and fit.rel_err_max <= 0.07


def test_decode_fit_keeps_an_absent_cost_at_zero_not_negative():
    # Step time that falls slightly with context (noise on a machine where KV reads are free).
    samples = [(b, b * c, 3e-3 + 1e-4 * b - 1e-10 * b * c) for b in (1, 4, 16) for c in (64, 1024)]
    fit = fit_decode(samples)
    assert fit.per_ctx_token_s == 0.0 and fit.fixed_s > 0 and fit.per_seq_s > 0


@pytest.mark.parametrize(
    "samples, match",
    [
        ([(1, 10, 1e-3), (2, 20, 2e-3)], ">= 3 samples"),
        ([(1, 1, 1e-3)] * 2 + [(0, 1, 1e-3)], "bad"),
    ],
)
def test_decode_fit_rejects_bad_input(samples, match):
    with pytest.raises(ValueError, match=match):
        fit_decode(samples)


def test_line_fit_gives_latency_and_bandwidth():
    xs = [1e5, 1e6, 1e7]
    intercept, slope = fit_line(xs, [2e-4 + x / 5e9 for x in xs])
    assert intercept == pytest.approx(2e-4) and 1 / slope == pytest.approx(5e9)


def _profile(**over) -> CapacityProfile:
    base = dict(
        model="m",
        hardware="h",
        source="measured",
        prefill_points=[(100, 0.01), (1000, 0.1)],
        decode_fixed_s=0.004,
        decode_per_seq_s=0.001,
        decode_per_ctx_token_s=1e-6,
        kv_bytes_per_token=1000,
        transfer_latency_s=0.002,
        transfer_bytes_per_s=1e8,
        kv_capacity_tokens=100_000,
        max_batch_tokens=1000,
        max_num_seqs=64,
        startup_s=10.0,
        request_overhead_s=0.003,
        token_overhead_s=0.0005,
    )
    return CapacityProfile(**{**base, **over})


def test_idle_request_by_hand():
    p = _profile()
    # 500-token prompt: prefill 0.05 s; 11 output tokens: 10 decode steps reading 501..510
    # tokens: 10 * (0.004 + 0.001) + 1e-6 * (5000 + 55) = 0.055055 s; hand-off 0.002 + 0.005.
    r = idle_request(p, 500, 11, disaggregated=True)
    assert r.engine_ttft_s == pytest.approx(0.05)
    assert r.ttft_s == pytest.approx(0.053)
    assert r.engine_tpot_s == pytest.approx((0.055055 + 0.007) / 10)
    assert r.tpot_s == pytest.approx((0.055055 + 0.007) / 10 + 0.0005)
    assert r.total_s == pytest.approx(r.ttft_s + 10 * r.tpot_s)
    local = idle_request(p, 500, 11, disaggregated=False)
    assert local.engine_tpot_s == pytest.approx(0.055055 / 10)


def test_idle_request_chunks_a_prompt_longer_than_the_step_budget():
    p = _profile()
    # 2500 tokens at a 1000-token budget: two full steps (0.1 s each) and one of 500 (0.05 s).
    assert idle_request(p, 2500, 1).engine_ttft_s == pytest.approx(0.25)
    assert idle_request(p, 2500, 1).tpot_s is None


def test_decode_steps_sum_matches_a_step_by_step_loop():
    p = _profile()
    loop = sum(p.decode_step_s(1, 300 + i) for i in range(1, 40))
    assert decode_steps_s(p, 300, 40) == pytest.approx(loop)
