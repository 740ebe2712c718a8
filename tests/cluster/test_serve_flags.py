"""`tandem serve`'s flags are generated from ServeSettings, RouterConfig and EngineConfig: every
setting is reachable from the command line, each default is the dataclass's own, and what a
flag says reaches the config the router or the workers are built from."""

from __future__ import annotations

import dataclasses

import pytest

from cluster import cli
from cluster.serve import ServeSettings, settings_from_args
from engine.config_flags import cli_fields, flag_name
from engine.llm_engine import EngineConfig
from router.config import RouterConfig


def _parse(*argv: str):
    full = ["serve", "--model", "/m", *argv]
    return cli.build_parser(full).parse_args(full)


def _option_strings() -> set[str]:
    parser = cli.build_parser(["serve", "--model", "/m"])
    serve = parser._subparsers._group_actions[0].choices["serve"]
    return {s for a in serve._actions for s in a.option_strings}


def test_every_setting_has_a_flag():
    options = _option_strings()
    expected = [f.name for f in cli_fields(ServeSettings)]
    expected += [f.name for f in cli_fields(EngineConfig)]
    expected += [f.name for f in cli_fields(RouterConfig)]
    assert len(expected) > 40
    # Router fields that serve owns appear once, under serve's own flag of the same name.
    missing = [
        n
        for n in expected
        if flag_name(n) not in options
        and n not in {"model_path", "max_frame_bytes", "default_block_size"}
    ]
    assert missing == []


def test_defaults_come_from_the_dataclasses():
    s = settings_from_args(_parse())
    for f in cli_fields(ServeSettings):
        if f.default is not dataclasses.MISSING:
            assert getattr(s, f.name) == f.default, f.name
    engine = EngineConfig(model="/m", **s.engine)
    assert engine == EngineConfig(model="/m")
    router = s.router_config("127.0.0.1")
    plain = RouterConfig(model_path="/m", max_frame_bytes=16 << 20)
    for f in dataclasses.fields(RouterConfig):
        assert getattr(router, f.name) == getattr(plain, f.name), f.name


def test_router_flags_reach_the_router_config():
    args = _parse(
        "--request-timeout-s",
        "7.5",
        "--token-gap-timeout-s",
        "3",
        "--max-body-bytes",
        "1024",
        "--send-timeout-s",
        "2",
        "--max-frame-mb",
        "2",
        "--block-size",
        "32",
        "--max-model-len",
        "512",
        "--port",
        "0",
    )
    cfg = settings_from_args(args).router_config("127.0.0.1")
    assert (cfg.request_timeout_s, cfg.token_gap_timeout_s, cfg.max_body_bytes) == (7.5, 3.0, 1024)
    assert cfg.send_timeout_s == 2.0 and cfg.max_frame_bytes == 2 << 20
    assert (cfg.default_block_size, cfg.max_model_len, cfg.port) == (32, 512, 0)


def test_engine_flags_reach_the_workers_config():
    s = settings_from_args(
        _parse("--no-chunked-prefill", "--no-prefix-caching", "--kv-dtype", "fp8_e4m3")
    )
    cfg = EngineConfig(model=s.model, **s.engine)
    assert not cfg.enable_chunked_prefill and not cfg.enable_prefix_caching
    assert cfg.kv_dtype == "fp8_e4m3"


def test_colocated_mode_prefills_everything_on_the_replicas():
    s = settings_from_args(_parse("--mode", "colocated", "--disagg-threshold", "10"))
    assert s.router_config("127.0.0.1").disagg_threshold > 1 << 20
    assert [role for _, role in s.pools()] == ["colocated", "colocated"]


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEY", "k1")
    assert settings_from_args(_parse()).api_key == "k1"
    assert settings_from_args(_parse("--api-key", "k2")).api_key == "k2"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "both"}, "mode"),
        ({"prefill": 0}, "prefill"),
        ({"on_transfer_failure": "ignore"}, "on_transfer_failure"),
        ({"router": {"port": 1}}, "set by ServeSettings"),
        ({"engine": {"role": "prefill"}}, "set by ServeSettings"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServeSettings(model="/m", **kwargs)
