"""The bench client's workload: length distributions, arrival schedules, prompts, payloads,
config validation and the CLI flags."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from bench.cli import config_from_args
from bench.client import build_payload, endpoint_url
from bench.config import CHAT, COMPLETIONS, BenchConfig
from bench.workload import arrival_offsets, build_workload, sample_lengths
from cluster.cli import build_parser


def test_sample_lengths_bounds_and_mean():
    rng = np.random.default_rng(0)
    x = sample_lengths(rng, 20000, 100, 0.5)
    assert x.dtype.kind == "i"
    assert x.min() == 50 and x.max() == 150  # both ends of U[50, 150] are reachable
    assert x.mean() == pytest.approx(100.0, abs=1.0)
    # Uniform on 101 integers: variance (101^2 - 1) / 12 = 850.
    assert x.var() == pytest.approx(850.0, rel=0.05)


def test_sample_lengths_edge_cases():
    rng = np.random.default_rng(1)
    assert (sample_lengths(rng, 50, 64, 0.0) == 64).all()
    assert (sample_lengths(rng, 50, 1, 0.9) == 1).all()  # U[0.1, 1.9] -> never below 1
    y = sample_lengths(rng, 5000, 3, 1.0)  # U[0, 6] clipped to [1, 6]
    assert y.min() == 1 and y.max() == 6
    assert set(np.unique(y)) == {1, 2, 3, 4, 5, 6}
    for bad in ((10, 0, 0.1), (10, 5, 1.5), (10, 5, -0.1)):
        with pytest.raises(ValueError):
            sample_lengths(rng, *bad)


def intervals(rate: float, burstiness: float, n: int = 40001, seed: int = 0) -> np.ndarray:
    offsets = arrival_offsets(np.random.default_rng(seed), n, rate, burstiness)
    assert offsets[0] == 0.0
    assert (np.diff(offsets) >= 0).all()
    return np.diff(offsets)


def test_poisson_arrivals_have_mean_one_over_rate_and_cv_one():
    gaps = intervals(10.0, 1.0)
    assert gaps.mean() == pytest.approx(0.1, rel=0.02)
    # Exponential: the standard deviation equals the mean.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_keeps_the_mean_and_scales_the_variance(burstiness):
    gaps = intervals(10.0, burstiness)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    # Gamma(shape=B, scale=1/(R B)): variance 1/(R^2 B), so CV^2 = 1/B.
    assert gaps.var() == pytest.approx(0.01 / burstiness, rel=0.08)
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1.0 / burstiness, rel=0.08)


def test_infinite_rate_sends_everything_at_once_and_seed_reproduces():
    assert (arrival_offsets(np.random.default_rng(0), 7, math.inf) == 0).all()
    a = arrival_offsets(np.random.default_rng(3), 100, 5.0, 0.5)
    b = arrival_offsets(np.random.default_rng(3), 100, 5.0, 0.5)
    assert (a == b).all()
    assert arrival_offsets(np.random.default_rng(0), 0, 1.0).size == 0
    with pytest.raises(ValueError):
        arrival_offsets(np.random.default_rng(0), 3, 0.0)


def test_random_workload_token_prompts_are_exact_and_seeded():
    cfg = BenchConfig(
        num_prompts=40,
        input_len=20,
        input_range=0.5,
        output_len=8,
        output_range=0.25,
        request_rate=50.0,
        vocab_low=10,
        vocab_high=20,
        seed=7,
    )
    w = build_workload(cfg)
    assert w.trace is None and len(w.requests) == 40
    for r in w.requests:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len
        assert 10 <= r.prompt_len <= 30 and 6 <= r.output_len <= 10
        assert all(10 <= t < 20 for t in r.prompt)
    arrivals = [r.arrival_s for r in w.requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    again = build_workload(cfg)
    assert [r.prompt for r in again.requests] == [r.prompt for r in w.requests]
    other = build_workload(BenchConfig(num_prompts=40, input_len=20, input_range=0.5, seed=8))
    assert [r.prompt for r in other.requests] != [r.prompt for r in w.requests]
    assert len(build_workload(BenchConfig(input_len=4, output_len=2)).requests) == 100


def test_chat_workload_uses_words():
    w = build_workload(BenchConfig(endpoint=CHAT, num_prompts=5, input_len=12))
    assert len(w.requests) == 5
    for r in w.requests:
        assert isinstance(r.prompt, str) and len(r.prompt.split()) == 12


def test_trace_workload_applies_scales(tmp_path: Path):
    path = tmp_path / "t.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:00:00.0,100,40\n2023-11-16 18:00:01.5,300,8\n"
        "2023-11-16 18:00:02.0,50,10\n"
    )
    cfg = BenchConfig(
        dataset=f"trace:{path}",
        num_prompts=2,
        trace_length_scale=0.1,
        trace_time_scale=0.5,
        trace_max_output=3,
    )
    w = build_workload(cfg)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in w.requests] == [
        (0.0, 10, 3),
        (pytest.approx(0.75), 30, 1),
    ]
    assert [len(r.prompt) for r in w.requests] == [10, 30]
    assert w.trace is not None and w.trace.num_requests == 2
    assert w.trace.rate_rps == pytest.approx(1 / 0.75)


def test_endpoint_url_and_payloads():
    assert endpoint_url("http://h:8000/", COMPLETIONS) == "http://h:8000/v1/completions"
    assert endpoint_url("http://h:8000/v1", CHAT) == "http://h:8000/v1/chat/completions"
    cfg = BenchConfig(num_prompts=1, input_len=3, output_len=5)
    req = build_workload(cfg).requests[0]
    p = build_payload(cfg, req, "m")
    assert p == {
        "model": "m",
        "prompt": req.prompt,
        "max_tokens": 5,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    chat_cfg = BenchConfig(endpoint=CHAT, num_prompts=1, input_len=3, ignore_eos=False)
    chat_req = build_workload(chat_cfg).requests[0]
    q = build_payload(chat_cfg, chat_req, None)
    assert "model" not in q and "ignore_eos" not in q and "prompt" not in q
    assert q["messages"] == [{"role": "user", "content": chat_req.prompt}]


@pytest.mark.parametrize(
    "bad",
    [
        {"endpoint": "/v1/embeddings"},
        {"dataset": "sharegpt"},
        {"dataset": "trace:"},
        {"request_rate": 0.0},
        {"burstiness": 0.0},
        {"max_concurrency": 0},
        {"input_range": 1.5},
        {"slo_ttft_ms": 0.0},
        {"vocab_low": 5, "vocab_high": 5},
        {"num_prompts": 0},
    ],
)
def test_config_validation(bad):
    with pytest.raises(ValueError):
        BenchConfig(**bad)


def test_cli_flags_build_the_config():
    argv = [
        "bench",
        "serve",
        "--base-url",
        "http://x:1",
        "--dataset",
        "trace:/tmp/t.csv",
        "--num-prompts",
        "7",
        "--request-rate",
        "inf",
        "--burstiness",
        "0.5",
        "--max-concurrency",
        "3",
        "--slo-ttft-ms",
        "200",
        "--slo-tpot-ms",
        "50",
        "--trace-length-scale",
        "0.1",
        "--trace-time-scale",
        "4",
        "--trace-max-input",
        "64",
        "--endpoint",
        CHAT,
        "--api-key",
        "sk",
        "--no-ignore-eos",
        "--no-progress",
    ]
    cfg = config_from_args(build_parser(argv).parse_args(argv))
    assert cfg.base_url == "http://x:1" and cfg.trace_path == "/tmp/t.csv"
    assert cfg.num_prompts == 7 and math.isinf(cfg.request_rate) and cfg.burstiness == 0.5
    assert cfg.max_concurrency == 3 and (cfg.slo_ttft_ms, cfg.slo_tpot_ms) == (200.0, 50.0)
    assert (cfg.trace_length_scale, cfg.trace_time_scale, cfg.trace_max_input) == (0.1, 4.0, 64)
    assert cfg.endpoint == CHAT and cfg.api_key == "sk"
    assert not cfg.ignore_eos and not cfg.progress
    assert cfg.to_dict()["api_key"] == "<redacted>"
    assert cfg.to_dict()["request_rate"] == "inf"
