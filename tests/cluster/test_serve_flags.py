"""`tandem serve`'s flags are generated from ServeSettings, RouterConfig and EngineConfig: every
setting is reachable from the command line, each default is the dataclass's own, and what a
flag says reaches the config the router or the workers are built from."""

from __future__ import annotations

import dataclasses

import pytest

from cluster import cli
from cluster.planner.config import PlannerConfig
from cluster.serve import Deployment, ServeSettings, settings_from_args
from cluster.settings import SLO_FIELDS
from engine.config_flags import cli_fields, flag_name
from engine.llm_engine import EngineConfig
from engine.quantization import resolve
from engine.roles import COLOCATED, DECODE, PREFILL
from engine.slo import SloTargets
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
        if f.name in SLO_FIELDS:  # the planner's, below
            continue
        assert getattr(router, f.name) == getattr(plain, f.name), f.name
    # The router's SLO metrics judge by the planner's targets, defaults included.
    planner = PlannerConfig()
    assert [getattr(router, n) for n in SLO_FIELDS] == [getattr(planner, n) for n in SLO_FIELDS]


def test_the_planner_slo_flags_reach_the_router_metrics():
    s = settings_from_args(
        _parse("--slo-ttft-ms", "250", "--slo-ttft-ms-per-1k", "40", "--slo-tpot-ms", "35")
    )
    router = s.router_config("127.0.0.1")
    assert router.slo_targets() == SloTargets(250.0, 40.0, 35.0)
    planner = PlannerConfig(**s.planner)  # the planner sizes for the same targets
    assert (planner.slo_ttft_ms, planner.slo_ttft_ms_per_1k, planner.slo_tpot_ms) == (250, 40, 35)
    assert "--slo-ttft-ms" in _option_strings()  # once: the planner's flag, not the router's


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


# ---- quantization: per pool, and the quantized profile ---------------------------------------


def _quantization(s: ServeSettings) -> tuple[str, str, str]:
    """(prefill, decode, KV dtype) a deployment of `s` gives its workers."""
    return s.prefill_quantization, s.decode_quantization, s.engine.get("kv_dtype", "auto")


def test_quantization_defaults_keep_the_checkpoint():
    s = settings_from_args(_parse())
    assert (s.quantized, _quantization(s)) == (False, ("auto", "auto", "auto"))
    assert _quantization(ServeSettings(model="/m")) == ("auto", "auto", "auto")


def test_quantized_is_fp8_prefill_weight_only_decode_fp8_kv():
    want = ("fp8", "weight-only", "fp8_e4m3")
    assert _quantization(settings_from_args(_parse("--quantized"))) == want
    # The Python form agrees with the command line.
    assert _quantization(ServeSettings(model="/m", quantized=True)) == want
    assert _quantization(settings_from_args(_parse("--quantized", "--no-quantized")))[0] == "auto"


@pytest.mark.parametrize(
    "argv, want",
    [
        # A per-pool setting given explicitly wins over the switch, in either order.
        (["--decode-quantization", "int8", "--quantized"], ("fp8", "int8", "fp8_e4m3")),
        (["--quantized", "--prefill-quantization", "none"], ("none", "weight-only", "fp8_e4m3")),
        (
            [
                "--quantized",
                "--prefill-quantization",
                "fp8-weight-only",
                "--decode-quantization",
                "none",
            ],
            ("fp8-weight-only", "none", "fp8_e4m3"),
        ),
        # `--kv-dtype auto` given explicitly cannot be told from the default: the switch sets
        # FP8 KV unless --kv-dtype names a concrete dtype (today fp8_e4m3 is the only one).
        (["--quantized", "--kv-dtype", "auto"], ("fp8", "weight-only", "fp8_e4m3")),
        (["--quantized", "--kv-dtype", "fp8_e4m3"], ("fp8", "weight-only", "fp8_e4m3")),
        # Without the switch each flag goes through as given.
        (["--decode-quantization", "int8"], ("auto", "int8", "auto")),
        (["--prefill-quantization", "fp8", "--kv-dtype", "fp8_e4m3"], ("fp8", "auto", "fp8_e4m3")),
    ],
)
def test_explicit_settings_win_over_the_quantized_switch(argv, want):
    assert _quantization(settings_from_args(_parse(*argv))) == want


def test_quantized_sets_the_kv_dtype_in_a_copy_of_the_engine_overrides():
    """The switch changes only an absent or "auto" kv_dtype (fp8_e4m3, today the only other
    KV dtype, stays as it is), and copies `engine` instead of changing the caller's dict."""
    engine = {"kv_dtype": "auto", "block_size": 32}
    s = ServeSettings(model="/m", quantized=True, engine=engine)
    assert s.engine == {"kv_dtype": "fp8_e4m3", "block_size": 32}
    assert engine == {"kv_dtype": "auto", "block_size": 32}
    # Applying the settings twice (dataclasses.replace runs __post_init__ again) is stable.
    again = dataclasses.replace(s)
    assert _quantization(again) == _quantization(s)


def test_decode_quantization_int8_keeps_the_prefill_pool_full():
    """`--decode-quantization int8` (tests/e2e/test_serve_quantized.py) as before: int8 on the
    decode pool and colocated replicas, the prefill pool on the checkpoint's weights."""
    s = settings_from_args(_parse("--decode-quantization", "int8"))
    dep = Deployment(s)
    assert (dep._quantization(PREFILL), dep._quantization(DECODE)) == ("auto", "int8")
    assert dep._quantization(COLOCATED) == "int8"
    assert s.engine["kv_dtype"] == "auto"
    # "auto" on a full checkpoint is full weights: the prefill worker's label stays the dtype.
    assert resolve(dep._quantization(PREFILL), False, "cpu") == "none"


def test_deployment_gives_each_pool_its_quantization():
    s = settings_from_args(
        _parse("--prefill-quantization", "fp8", "--decode-quantization", "fp8-weight-only")
    )
    dep = Deployment(s)  # no Ray: nothing starts until .start()
    assert dep._quantization(PREFILL) == "fp8"
    assert dep._quantization(DECODE) == dep._quantization(COLOCATED) == "fp8-weight-only"
    quantized = Deployment(ServeSettings(model="/m", quantized=True))
    assert (quantized._quantization(PREFILL), quantized._quantization(DECODE)) == (
        "fp8",
        "weight-only",
    )


@pytest.mark.parametrize("flag", ["--prefill-quantization", "--decode-quantization"])
def test_an_unknown_quantization_is_refused_naming_the_flag(flag, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(flag, "bogus")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: invalid choice: 'bogus'" in err
    assert "weight-only" in err  # the choices are listed


@pytest.mark.parametrize("field", ["prefill_quantization", "decode_quantization"])
def test_an_unknown_quantization_is_refused_by_the_python_form(field):
    with pytest.raises(ValueError, match="quantization must be one of"):
        ServeSettings(model="/m", **{field: "int4"})


def test_one_tokenizer_flag_reaches_the_router_and_the_workers():
    s = settings_from_args(_parse("--tokenizer", "/tok"))
    assert s.router_config("127.0.0.1").tokenizer == "/tok"
    assert EngineConfig(model=s.model, **s.engine).tokenizer == "/tok"


def test_host_kv_tier_flag_reaches_every_worker_engine():
    settings = settings_from_args(_parse("--kv-host-cache-gb", "2.5"))
    assert settings.engine["kv_host_cache_gb"] == 2.5
    assert settings_from_args(_parse()).engine["kv_host_cache_gb"] == 0.0


# ---- tensor parallelism: per pool, counted in GPUs -------------------------------------------


def test_tp_flags_reach_each_pools_workers_and_the_planner():
    from cluster.worker_launch import WorkerSpec

    s = settings_from_args(_parse("--prefill-tp", "2", "--decode-tp", "4", "--prefill", "3"))
    assert (s.tp_size(PREFILL), s.tp_size(DECODE), s.tp_size(COLOCATED)) == (2, 4, 1)
    assert s.max_ranks() == 3 * 2 + 1 * 4  # the CPU shares are per rank
    planner = s.planner_config()
    assert planner.pool_gpus(1) == {"prefill": 2, "decode": 4}
    spec = WorkerSpec(
        engine_kwargs={"model": s.model, **s.engine},
        quantization={},
        bind_host="127.0.0.1",
        use_gpu=True,
        cpus_per_worker=1.0,
        lease_seconds=1.0,
        on_transfer_failure="recompute",
        log_level="WARNING",
        max_frame_bytes=1 << 20,
        kv_read_timeout_s=1.0,
        max_restarts=0,
        tp={role: s.tp_size(role) for role in (PREFILL, DECODE, COLOCATED)},
    )
    # What the actor's EngineConfig gets; the group asks one GPU per rank.
    assert spec.engine_config(DECODE)["tensor_parallel_size"] == 4
    assert len(spec.bundles(PREFILL)) == 2 and len(spec.bundles(DECODE)) == 4
    colocated = settings_from_args(_parse("--mode", "colocated", "--tp", "2"))
    assert colocated.tp_size(COLOCATED) == 2 and colocated.max_ranks() == 2 * 2


@pytest.mark.parametrize("flag", ["--prefill-tp", "--decode-tp", "--tp"])
@pytest.mark.parametrize("value", ["0", "17"])
def test_a_tp_size_out_of_range_is_refused_naming_the_flag(flag, value):
    with pytest.raises(ValueError, match=f"{flag} must be an integer in \\[1, 16\\]"):
        settings_from_args(_parse(flag, value))


def test_tp_is_set_by_serve_not_by_engine_overrides():
    with pytest.raises(ValueError, match="set by ServeSettings"):
        ServeSettings(model="/m", engine={"tensor_parallel_size": 2})


def test_a_tp_size_the_model_cannot_split_fails_at_start_before_ray(make_tiny_model):
    """The engine's own check (4 attention heads are not split 3 ways), raised by
    Deployment.start before Ray or any worker starts: not a worker failing in a restart loop."""
    model = str(make_tiny_model("llama", "tiny", 0))
    dep = Deployment(ServeSettings(model=model, mode="colocated", tp=3))
    with pytest.raises(ValueError, match="--tp 3: tensor_parallel_size 3 must divide num_att"):
        dep.start()
    assert dep.controller is None and not dep.actors
    ServeSettings(model=model, mode="colocated", tp=2).check_tp()  # 4 heads, 2 KV heads: fine


def test_serve_help_documents_the_tp_flags(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser(["serve", "--help"]).parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--prefill-tp", "--decode-tp", "--tp "):
        assert flag in out


@pytest.mark.parametrize("role", [PREFILL, DECODE])
def test_a_pool_tp_size_meets_the_engines_own_role_check_at_start(make_tiny_model, role):
    """`--prefill-tp 2` / `--decode-tp 2` on a model TP 2 can split: the engine runs TP 2 in
    both roles (a decode group's ranks READ their own KV heads: kv_transfer/tp_read.py), so
    `tandem serve` accepts both at start; a size the engine refuses is refused naming the
    flag."""
    from engine.models.parallel import check_tp_settings

    model = str(make_tiny_model("llama", "tiny", 0))
    check_tp_settings(2, role, "auto")  # no role refuses TP 2 any more
    ServeSettings(model=model, **{f"{role}_tp": 2}).check_tp()
    with pytest.raises(ValueError) as got:
        ServeSettings(model=model, **{f"{role}_tp": 3}).check_tp()
    assert str(got.value).startswith(f"--{role}-tp 3: ")


def _race_ready_file(tmp_path, write) -> int:
    """Times a reader that polls for the ready file (as bench/live_server.py does) read it
    before it was whole, over 100 writes of a large payload by `write`."""
    import json
    import threading

    path = tmp_path / "ready.json"
    payload = {"url": "http://127.0.0.1:1", "pid": 1, "pad": "x" * 1_000_000}
    torn, done = [0], threading.Event()

    def reader():
        while not done.is_set():
            if path.exists():
                try:
                    json.loads(path.read_text())
                except FileNotFoundError:
                    pass  # unlinked for the next write between exists() and the read
                except ValueError:
                    torn[0] += 1

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(100):
            path.unlink(missing_ok=True)
            write(str(path), payload)
    finally:
        done.set()
        t.join()
    return torn[0]


def test_ready_file_is_never_seen_half_written(tmp_path):
    import json

    from cluster.serve import write_ready_file

    def plain(path, payload):  # what serve did before: open, then write
        with open(path, "w") as f:
            json.dump(payload, f)

    assert _race_ready_file(tmp_path, plain) > 0  # the race exists, and this sees it
    assert _race_ready_file(tmp_path, write_ready_file) == 0
    assert not list(tmp_path.glob("*.tmp"))


def test_one_scheduling_policy_flag_reaches_the_router_and_the_workers():
    """The router refuses a request's priority unless the workers order by it: both read the
    one engine flag."""
    s = settings_from_args(_parse("--scheduling-policy", "priority"))
    assert s.router_config("127.0.0.1").scheduling_policy == "priority"
    assert EngineConfig(model=s.model, **s.engine).scheduling_policy == "priority"
    assert settings_from_args(_parse()).router_config("127.0.0.1").scheduling_policy == "fcfs"
