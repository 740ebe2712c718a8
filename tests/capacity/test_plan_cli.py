"""`tandem plan` end to end: the numbers it prints are the roofline's and the idle-request
timeline's, the rate sizing is the planner's, bad input is a clear error (exit 2)."""

from __future__ import annotations

import json

import pytest

from bench.capacity_model import idle_request
from bench.capacity_profile import CapacityProfile
from cluster import cli
from cluster.plan import PlanConfig, size_for_rate, synthetic_window
from cluster.planner.config import PlannerConfig
from cluster.planner.gpus import gpu
from cluster.planner.model_shapes import PRESETS
from cluster.planner.roofline import Hardware, RooflineSettings, roofline_profile
from router.signals import LengthHistogram


def _plan(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_prints_the_idle_request_and_writes_the_profile(capsys, tmp_path):
    out_path = tmp_path / "p.json"
    rc, out, _ = _plan(
        capsys, "--model", "llama-3-8b", "--gpu", "h100", "--prompt", "1024,300",
        "--output", "256,2", "--disagg-threshold", "512", "--out", str(out_path),
    )  # fmt: skip
    assert rc == 0
    profile = CapacityProfile.load(out_path)
    expected = roofline_profile(PRESETS["llama-3-8b"], Hardware.of(gpu("h100")), RooflineSettings())
    assert profile.to_dict() == CapacityProfile.from_dict(expected.to_dict()).to_dict()
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("1024", "300"))]
    long, short = (idle_request(profile, 1024, 256, True), idle_request(profile, 300, 2, False))
    assert rows[0][:3] == ["1024", "256", "disagg"] and rows[1][:3] == ["300", "2", "local"]
    assert float(rows[0][3]) == pytest.approx(long.ttft_s * 1e3, abs=0.05)
    assert float(rows[0][4]) == pytest.approx(long.tpot_s * 1e3, abs=0.005)
    assert float(rows[1][5]) == pytest.approx(short.total_s, abs=0.005)


def test_plan_on_custom_hardware_flags(capsys, tmp_path):
    out_path = tmp_path / "p.json"
    rc, out, _ = _plan(
        capsys, "--model", "qwen2.5-7b", "--bandwidth-gbs", "1000", "--tflops", "200",
        "--memory-gb", "48", "--bw-efficiency", "0.8", "--step-overhead-ms", "0", "--out",
        str(out_path),
    )  # fmt: skip
    assert rc == 0 and "custom" in out
    p = CapacityProfile.load(out_path)
    assert p.decode_per_ctx_token_s == pytest.approx(
        PRESETS["qwen2.5-7b"].kv_bytes_per_token() / 0.8e12
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "llama-3-8b", "--gpu", "v100"], "unknown GPU 'v100'"),
        (["--model", "gpt-9", "--gpu", "h100"], "unknown model 'gpt-9'"),
        (["--model", "llama-3-8b"], "give --gpu"),
        (["--gpu", "h100"], "--model"),
        (["--model", "llama-3-70b", "--gpu", "l4"], "does not fit"),
        (["--model", "llama-3-8b", "--gpu", "h100", "--rate", "3"], "length mix"),
        (["--model", "llama-3-8b", "--gpu", "a100", "--weight-dtype", "fp8"], "FP8"),
        (["--model", "llama-3-8b", "--gpu", "h100", "--calibrate", "x.json"], "--calibrate-"),
    ],
)
def test_plan_errors_are_clear(capsys, argv, message):
    rc, _, err = _plan(capsys, *argv)
    assert rc == 2 and message in err and err.startswith("tandem plan: ")


def test_list_names_the_gpus_and_models(capsys):
    rc, out, _ = _plan(capsys, "--list-known")
    assert rc == 0 and "b200" in out and "llama-3-70b" in out


def _profile():
    return roofline_profile(PRESETS["llama-3-8b"], Hardware.of(gpu("h100")), RooflineSettings())


def test_synthetic_window_has_the_rate_and_mix():
    p, o = LengthHistogram(), LengthHistogram()
    for n in (100, 3000):
        p.add(n)
        o.add(n // 10)
    w = synthetic_window(2.5, 800, p, o, threshold=512)
    assert w.arrival_rate == pytest.approx(2.5) and w.arrivals == 2000
    assert w.prompt_lengths.mean() == pytest.approx(1550) and w.local_prefills == 1000
    assert w.uncached_prompt_tokens == w.prompt_lengths.total
    assert w.output_lengths.count == 2000


def test_sizing_grows_with_the_rate_and_with_the_mix():
    cfg = PlannerConfig(max_prefill=1000, max_decode=1000)
    long_prompts, short_outputs = LengthHistogram(), LengthHistogram()
    long_prompts.add(8000)
    short_outputs.add(50)
    prof = _profile()
    low = size_for_rate(prof, cfg, 1.0, long_prompts, short_outputs).desired
    high = size_for_rate(prof, cfg, 40.0, long_prompts, short_outputs).desired
    assert high["prefill"] > low["prefill"] >= 1
    # Prefill-heavy: 40 x 8000 prompt tokens/s needs far more prefill than decode workers.
    assert high["prefill"] > high["decode"]
    short_prompts, long_outputs = LengthHistogram(), LengthHistogram()
    short_prompts.add(200)
    long_outputs.add(2000)
    heavy = size_for_rate(prof, cfg, 40.0, short_prompts, long_outputs).desired
    assert heavy["decode"] > heavy["prefill"]


def test_plan_sizes_from_a_trace(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 250 * i, "input_length": 4000, "output_length": 100} for i in range(41)]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    rc, out, _ = _plan(capsys, "--model", "llama-3-8b", "--gpu", "h100", "--trace", str(trace))
    assert rc == 0 and "at 4 req/s: prefill" in out


def test_plan_takes_a_sharegpt_files_length_mix_and_no_rate_from_it(capsys, tmp_path):
    turns = [{"from": "human", "value": "p" * 16000}, {"from": "gpt", "value": "r" * 400}]
    trace = tmp_path / "sharegpt.json"
    trace.write_text(json.dumps([{"id": str(i), "conversations": turns} for i in range(10)]))
    # Its drawn arrivals are no rate: without --rate it asks for one; with it, plans the mix.
    args = ("--model", "llama-3-8b", "--gpu", "h100", "--trace", str(trace))
    rc, out, err = _plan(capsys, *args)
    assert rc != 0 and "give --rate" in out + err
    rc, out, _ = _plan(capsys, *args, "--rate", "4")
    assert rc == 0 and "at 4 req/s: prefill" in out


def test_plan_calibrates_from_a_measured_profile(capsys, tmp_path, make_tiny_model):
    model_dir = make_tiny_model("llama", "tiny", 0)
    from cluster.planner.model_shapes import shape_from_config
    from cluster.planner.roofline import Efficiency

    shape = shape_from_config(model_dir)
    hw = Hardware("cpu", 20, 0.2, 16, 5)
    settings = RooflineSettings(efficiency=Efficiency(0.4, 0.3, 2e-3), max_batch_tokens=1024)
    measured = roofline_profile(shape, hw, settings)
    measured.source, measured.measurements = "measured", {"config": {"model": str(model_dir)}}
    measured.request_overhead_s, measured.token_overhead_s = 3e-3, 5e-4
    path = measured.save(tmp_path / "measured.json")
    rc, out, _ = _plan(
        capsys, "--model", "llama-3-8b", "--gpu", "h100", "--calibrate", str(path),
        "--calibrate-bandwidth-gbs", "20", "--calibrate-tflops", "0.2", "--step-overhead-ms", "2",
    )  # fmt: skip
    assert rc == 0
    assert (
        "bandwidth x0.40 (KV reads x0.40), FLOP/s x0.30, step overhead 2.00 ms, calibrated" in out
    )
    # The overheads outside the engine are the same software's: carried over.
    assert "outside the engine 3.00 ms per request, 0.500 ms per token" in out


def test_plan_config_pairs_broadcast_a_single_length():
    assert PlanConfig(model="m", gpu="h100", prompt=(10, 20), output=(5,)).pairs() == [
        (10, 5),
        (20, 5),
    ]
    with pytest.raises(ValueError, match="as many"):
        PlanConfig(model="m", gpu="h100", prompt=(1, 2, 3), output=(1, 2))
