"""PlannerConfig: the shared defaults, validation naming the field, the generated flags."""

from __future__ import annotations

import argparse

import pytest

from cluster.planner.config import PlannerConfig
from engine.config_flags import add_flags, values_from_args


def test_defaults_are_the_shared_interface():
    c = PlannerConfig()
    assert (c.slo_ttft_ms, c.slo_tpot_ms, c.interval_s) == (1000, 100, 10)
    assert (c.min_prefill, c.max_prefill, c.min_decode, c.max_decode) == (1, 8, 1, 8)
    assert (c.gpu_budget, c.startup_s, c.disagg_threshold) == (None, None, 0)
    assert (c.up_cooldown_s, c.down_cooldown_s, c.down_stable_windows, c.headroom) == (
        0,
        120,
        3,
        0.1,
    )
    assert (c.slo_ttft_s, c.slo_tpot_s) == (1.0, 0.1)


@pytest.mark.parametrize(
    "field,value",
    [
        ("slo_ttft_ms", 0),
        ("slo_tpot_ms", -1),
        ("interval_s", float("nan")),
        ("min_prefill", -1),
        ("min_decode", 0),
        ("max_decode", 0),
        ("gpu_budget", 0),
        ("startup_s", -1),
        ("disagg_threshold", -5),
        ("down_cooldown_s", -1),
        ("down_stable_windows", 0),
        ("down_step", 0),
        ("headroom", 1.0),
        ("down_margin", -0.1),
        ("forecast_alpha", 0),
        ("correction_alpha", 1.5),
        ("expected_rate_rps", -1),
        ("expected_output_tokens", 0),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        PlannerConfig(**{field: value})


def test_max_below_min_is_refused():
    with pytest.raises(ValueError, match="max_prefill"):
        PlannerConfig(min_prefill=4, max_prefill=2)


def test_budget_must_hold_the_minimums():
    two = {"prefill": 2, "decode": 2}
    assert PlannerConfig(gpu_budget=9).budget_gpus(two) == 9
    assert PlannerConfig().budget_gpus({"prefill": 1, "decode": 1}) is None
    with pytest.raises(ValueError, match="gpu_budget"):
        PlannerConfig(min_prefill=2, min_decode=2, gpu_budget=7).budget_gpus(two)
    # Workers x their pool's TP: 2 x 4 + 1 x 2 = 10 GPUs.
    tp = PlannerConfig(
        min_prefill=2, min_decode=1, decode_gpus_per_worker=2, prefill_gpus_per_worker=4
    )
    assert tp.pool_gpus(1) == {"prefill": 4, "decode": 2}
    assert PlannerConfig().pool_gpus(8) == {"prefill": 8, "decode": 8}  # the profile's
    with pytest.raises(ValueError, match="= 10"):
        PlannerConfig(**{**_fields(tp), "gpu_budget": 9}).budget_gpus(tp.pool_gpus(1))
    with pytest.raises(ValueError, match="decode_gpus_per_worker"):
        PlannerConfig(decode_gpus_per_worker=0)


def _fields(c: PlannerConfig) -> dict:
    return {f: getattr(c, f) for f in c.__dataclass_fields__}


def test_flags_are_generated_and_tuning_stays_off_the_cli():
    parser = argparse.ArgumentParser()
    add_flags(parser, PlannerConfig)
    args = parser.parse_args(
        ["--slo-ttft-ms", "500", "--max-decode", "12", "--gpu-budget", "16", "--startup-s", "90"]
    )
    c = PlannerConfig(**values_from_args(PlannerConfig, args))
    assert (c.slo_ttft_s, c.max_decode, c.gpu_budget, c.startup_s) == (0.5, 12, 16, 90.0)
    flags = parser.format_help()
    assert "--down-stable-windows" in flags and "--expected-rate-rps" in flags
    assert "--forecast-alpha" not in flags and "--correction-decay" not in flags


def test_startup_falls_back_to_the_profile_and_priors_to_the_expected_lengths():
    assert PlannerConfig().resolved_startup_s(75.0) == 75.0
    assert PlannerConfig(startup_s=0).resolved_startup_s(75.0) == 0.0
    c = PlannerConfig(expected_prompt_tokens=3000)
    assert (c.prior_prompt_tokens, c.prior_output_tokens) == (3000, c.default_output_tokens)
