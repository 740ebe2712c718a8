"""RouterConfig is the one place router settings are written: every field is a flag, and the
flags' defaults are the dataclass defaults."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from engine.config_flags import field_default, flag_name
from router.config import RouterConfig, add_arguments, config_from_args


def router_parser(exclude: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser, exclude=exclude)
    return parser


def test_every_field_has_a_flag_with_the_dataclass_default():
    parser = router_parser()
    flags = {opt for action in parser._actions for opt in action.option_strings}
    args = parser.parse_args([])
    for f in dataclasses.fields(RouterConfig):
        if f.name == "model_path":  # the caller's own argument
            assert flag_name(f.name) not in flags
            continue
        assert flag_name(f.name) in flags, f"RouterConfig.{f.name} has no flag"
        assert getattr(args, f.name) == f.default, f.name
    assert config_from_args(args, "m") == RouterConfig(model_path="m")


def test_flags_reach_the_config():
    argv = [
        "--send-timeout-s=2.5",
        "--refresh-interval-s=0.25",
        "--max-frame-bytes=4096",
        "--affinity-prefix-tokens=32",
        "--decode-batch-norm=8",
        "--served-model-name=tiny",
        "--api-key=k",
    ]
    cfg = config_from_args(router_parser().parse_args(argv), "m")
    assert (cfg.send_timeout_s, cfg.refresh_interval_s, cfg.max_frame_bytes) == (2.5, 0.25, 4096)
    assert (cfg.affinity_prefix_tokens, cfg.decode_batch_norm) == (32, 8)
    assert (cfg.served_model_name, cfg.api_key) == ("tiny", "k")


def test_excluded_flags_keep_defaults_and_overrides_win():
    parser = router_parser(exclude=("port", "disagg_threshold"))
    with pytest.raises(SystemExit):
        parser.parse_args(["--port=1"])
    cfg = config_from_args(parser.parse_args(["--host=0.0.0.0"]), "m", advertise_host="10.0.0.1")
    assert cfg.port == field_default(RouterConfig, "port")
    assert cfg.disagg_threshold == field_default(RouterConfig, "disagg_threshold")
    assert (cfg.host, cfg.advertise_host) == ("0.0.0.0", "10.0.0.1")


def test_config_validation_still_runs():
    with pytest.raises(ValueError, match="send_timeout_s"):
        config_from_args(router_parser().parse_args(["--send-timeout-s=0"]), "m")


def test_an_unknown_scheduling_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        RouterConfig(model_path="/m", scheduling_policy="lifo")


def test_admission_and_metrics_key_flags():
    argv = ["--max-queued-requests=3", "--max-queued-prompt-tokens=0", "--no-metrics-require-key"]
    cfg = config_from_args(router_parser().parse_args(argv), "m")
    assert (cfg.max_queued_requests, cfg.max_queued_prompt_tokens) == (3, 0)
    assert cfg.metrics_require_key is False
    defaults = RouterConfig(model_path="m")
    assert (defaults.max_queued_requests, defaults.max_queued_prompt_tokens) == (512, 1 << 20)
    assert defaults.metrics_require_key is True
    for name in ("max_queued_requests", "max_queued_prompt_tokens"):
        with pytest.raises(ValueError, match=name):
            RouterConfig(model_path="m", **{name: -1})
    with pytest.raises(ValueError, match="metrics_require_key"):
        RouterConfig(model_path="m", metrics_require_key="no")  # type: ignore[arg-type]
