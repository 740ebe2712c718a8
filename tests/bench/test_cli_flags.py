"""The flags of `tandem bench serve`, `tandem profile` and `tandem bench kv-transfer` are
generated from their config dataclasses: every documented spelling still parses, and the
defaults a bare command gets are the dataclasses' own."""

from __future__ import annotations

import dataclasses
import math

from bench.cli import config_from_args
from bench.config import CHAT, BenchConfig
from bench.kv_transfer import KVBenchConfig
from bench.profile import DEFAULT_OUT, ProfileConfig
from cluster.cli import build_parser
from engine.config_flags import values_from_args


def parse(argv: list[str]):
    return build_parser(argv).parse_args(argv)


SERVE_FLAGS = [
    ("--base-url", "http://x:1", "base_url", "http://x:1"),
    ("--endpoint", CHAT, "endpoint", CHAT),
    ("--model", "m", "model", "m"),
    ("--api-key", "sk", "api_key", "sk"),
    ("--dataset", "trace:/t.csv", "dataset", "trace:/t.csv"),
    ("--num-prompts", "7", "num_prompts", 7),
    ("--input-len", "5", "input_len", 5),
    ("--input-range", "0.5", "input_range", 0.5),
    ("--output-len", "6", "output_len", 6),
    ("--output-range", "0.25", "output_range", 0.25),
    ("--request-rate", "2.5", "request_rate", 2.5),
    ("--burstiness", "0.5", "burstiness", 0.5),
    ("--max-concurrency", "3", "max_concurrency", 3),
    ("--seed", "4", "seed", 4),
    ("--slo-ttft-ms", "200", "slo_ttft_ms", 200.0),
    ("--slo-tpot-ms", "50", "slo_tpot_ms", 50.0),
    ("--vocab-low", "3", "vocab_low", 3),
    ("--vocab-high", "9", "vocab_high", 9),
    ("--temperature", "0.5", "temperature", 0.5),
    ("--request-timeout", "12", "request_timeout_s", 12.0),
    ("--trace-length-scale", "0.1", "trace_length_scale", 0.1),
    ("--trace-time-scale", "4", "trace_time_scale", 4.0),
    ("--trace-max-input", "64", "trace_max_input", 64),
    ("--trace-max-output", "8", "trace_max_output", 8),
    ("--result-json", "r.json", "result_json", "r.json"),
    ("--plot-dir", "p", "plot_dir", "p"),
]


def test_bench_serve_every_flag_spelling_parses():
    assert len(SERVE_FLAGS) == 26
    argv = ["bench", "serve", "--no-ignore-eos", "--no-progress"]
    for flag, text, _, _ in SERVE_FLAGS:
        argv += [flag, text]
    cfg = config_from_args(parse(argv))
    for flag, _, name, value in SERVE_FLAGS:
        assert getattr(cfg, name) == value, flag
    assert not cfg.ignore_eos and not cfg.progress
    assert math.isinf(
        config_from_args(parse(["bench", "serve", "--request-rate", "inf"])).request_rate
    )
    new_spelling = ["bench", "serve", "--request-timeout-s", "7"]
    assert config_from_args(parse(new_spelling)).request_timeout_s == 7.0


def test_bench_serve_defaults_are_the_dataclass_defaults():
    assert config_from_args(parse(["bench", "serve"])) == BenchConfig()


def test_profile_flags_and_defaults():
    args = parse(["profile"])
    assert args.model is None and args.out == DEFAULT_OUT
    assert ProfileConfig(
        model="m", **values_from_args(ProfileConfig, args, ("model",))
    ) == ProfileConfig(model="m")
    argv = ["profile", "--model", "mm", "--lengths", "16,8", "--positions", "5,3"]
    argv += ["--max-position", "64", "--repeats", "2", "--threads", "2", "--seed", "3"]
    argv += ["--load-format", "dummy", "--attention-backend", "torch", "--dtype", "bfloat16"]
    args = parse(argv + ["--out", "o"])
    cfg = ProfileConfig(model=args.model, **values_from_args(ProfileConfig, args, ("model",)))
    assert dataclasses.asdict(cfg) == {
        "model": "mm",
        "dtype": "bfloat16",
        "lengths": (8, 16),
        "positions": (3, 5),
        "max_position": 64,
        "repeats": 2,
        "threads": 2,
        "window": 8,  # not a flag
        "seed": 3,
        "load_format": "dummy",
        "attention_backend": "torch",
    }
    assert args.out == "o"


def test_kv_transfer_flags_and_defaults():
    assert KVBenchConfig(**values_from_args(KVBenchConfig, parse(["bench", "kv-transfer"]))) == (
        KVBenchConfig()
    )
    argv = ["bench", "kv-transfer", "--size-mb", "8", "--json", "--repeats", "3"]
    argv += ["--kv-dtype", "fp8_e4m3", "--max-read-mb", "16"]
    cfg = KVBenchConfig(**values_from_args(KVBenchConfig, parse(argv)))
    assert cfg == KVBenchConfig(
        size_mb=8.0, json=True, repeats=3, kv_dtype="fp8_e4m3", max_read_mb=16.0
    )
    assert cfg.sizes_mb() == [8.0]
    assert KVBenchConfig().sizes_mb() == [1, 4, 16, 64, 256]
    assert KVBenchConfig(size_mb=3).sizes_mb() == [1, 3, 4, 16, 64, 256]


def _documented_commands() -> list[list[str]]:
    """`tandem bench ...` / `tandem profile ...` commands in the READMEs: fenced shell lines
    (with continuations) and inline code spans."""
    import re
    import shlex
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    found = []
    for readme in ("bench/README.md", "benchmarks/README.md", "kv_transfer/README.md"):
        text = (repo / readme).read_text().replace("\\\n", " ")
        spans = re.findall(r"^(tandem (?:bench|profile)\b.*)$", text, flags=re.M)
        spans += re.findall(r"`(tandem (?:bench|profile)\b[^`]*)`", text)
        for span in spans:
            if "[" in span:  # a usage synopsis, not a command
                continue
            words = shlex.split(span.split("#")[0])
            if len(words) > 2 or words[1] == "profile":
                found.append(words[1:])
    return found


def test_every_documented_bench_command_parses():
    commands = _documented_commands()
    assert len(commands) >= 5, commands  # the scan found the READMEs' commands
    for argv in commands:
        try:
            parse(argv)
        except SystemExit as e:
            raise AssertionError(f"`tandem {' '.join(argv)}` does not parse") from e
