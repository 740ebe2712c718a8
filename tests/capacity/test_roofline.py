"""The roofline profile against numbers worked out by hand for a small made-up model and GPU;
the GPU table and model presets against the published figures; config.json parsing; and
calibration recovering known efficiency factors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bench.capacity_profile import CapacityProfile
from cluster.planner.gpus import GPUS, gpu
from cluster.planner.model_shapes import PRESETS, ModelShape, model_shape, shape_from_config
from cluster.planner.roofline import (
    ALLREDUCE_LATENCY_S,
    Efficiency,
    Hardware,
    RooflineSettings,
    calibrate,
    prefill_token_counts,
    roofline_profile,
)

# Layers 2, hidden 64, MLP 128, 4 heads of 16 (2 KV heads), vocab 100, untied.
TOY = ModelShape("toy", 2, 64, 128, 4, 2, 16, 100)
# Per layer: q 64*64 + k,v 2*64*32 + o 64*64 = 12288; MLP 3*64*128 = 24576; norms 128.
LAYER = 12288 + 24576 + 128
TABLE = 100 * 64
# 1 TB/s, 100 TFLOP/s, 1 GB, 10 GB/s link.
TOY_HW = Hardware("toy-gpu", 1000, 100, 1, 10)
EFF = Efficiency(0.5, 0.25, 1e-4)


def _settings(**over) -> RooflineSettings:
    base = dict(efficiency=EFF, activation_reserve_gb=0.0, max_batch_tokens=64, max_num_seqs=8)
    return RooflineSettings(**{**base, **over})


def test_toy_shape_counts_by_hand():
    assert TOY.layer_params == LAYER
    assert TOY.num_params == 2 * LAYER + 2 * TABLE + 64
    # K and V, 2 layers, 2 KV heads of 16, 2 bytes; FP8: 1 byte + a 4-byte scale per head.
    assert TOY.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 2 == 256
    assert TOY.kv_bytes_per_token("fp8_e4m3") == 2 * 2 * 2 * (16 + 4)
    # 32 tokens: projections 2*2*LAYER*32, LM head once, attention 2*2*4*16*32^2.
    assert TOY.prefill_flops(32) == 2 * 2 * LAYER * 32 + 2 * TABLE + 2 * 2 * 4 * 16 * 32**2
    # Two prompts of 16: the attention is two 16^2 squares.
    assert TOY.prefill_flops(32, prompts=2) == (
        2 * 2 * LAYER * 32 + 2 * 2 * TABLE + 2 * 2 * 4 * 16 * 2 * 16**2
    )


def test_toy_profile_by_hand():
    p = roofline_profile(TOY, TOY_HW, _settings())
    w = (2 * LAYER + TABLE) * 2  # projections and the LM head, bf16
    bw, flops = 1e12 * 0.5, 100e12 * 0.25
    assert p.source == "roofline" and p.gpus_per_worker == 1
    assert p.decode_fixed_s == pytest.approx(w / bw + 1e-4)
    assert p.decode_per_seq_s == pytest.approx(2 * (2 * LAYER + TABLE) / flops)
    assert p.decode_per_ctx_token_s == pytest.approx(256 / bw)
    assert p.kv_bytes_per_token == 256
    assert p.transfer_bytes_per_s == pytest.approx(10e9 * 0.5)
    assert p.transfer_latency_s == pytest.approx(1e-3)
    # Memory: 0.9 GB usable minus the weights (step weights + the untied embedding table).
    assert p.kv_capacity_tokens == int((0.9e9 - w - TABLE * 2) // 256)
    assert [t for t, _ in p.prefill_points] == [16, 32, 64]
    for t, s in p.prefill_points:
        compute = TOY.prefill_flops(t) / flops
        memory = (w + t * 256) / bw
        assert s == pytest.approx(max(compute, memory) + 1e-4)
    # Start-up: 40 s plus the weights at 1 GB/s.
    assert p.startup_s == pytest.approx(40 + (w + TABLE * 2) / 1e9)
    # Its attention term is known, not fitted: 2 x layers x heads x head_dim FLOPs per
    # squared prompt token, at the prefill FLOP/s.
    per_token2 = 2 * TOY.num_layers * TOY.num_heads * TOY.head_dim
    assert p.prefill_attention_s == pytest.approx(per_token2 / flops)
    assert TOY.prefill_flops(64, prompts=2) == pytest.approx(
        TOY.prefill_flops(64) - per_token2 * (64**2 - 2 * 32**2) + 2 * TABLE
    )


def test_prefill_turns_compute_bound_as_tokens_grow():
    # A fast memory and slow compute: even 16 tokens are compute-bound; the reverse: memory.
    slow = roofline_profile(TOY, Hardware("slow-flops", 1e6, 0.001, 1, 10), _settings())
    fast = roofline_profile(TOY, Hardware("fast-flops", 1, 1e6, 1, 10), _settings())
    ratio = slow.prefill_s(64) / slow.prefill_s(16)
    assert ratio > 3.9  # FLOPs ~ 4x (attention a little more)
    w = (2 * LAYER + TABLE) * 2
    for t in (16, 64):  # memory-bound: the weights read once, plus the KV the step writes
        assert fast.prefill_s(t) == pytest.approx((w + 256 * t) / (1e9 * 0.5) + 1e-4)


def test_tensor_parallel_splits_the_weights_and_sums_the_gpus():
    one = roofline_profile(PRESETS["llama-3-70b"], Hardware.of(gpu("h100"), tp=4), _settings())
    assert one.gpus_per_worker == 4 and one.hardware == "h100-sxm x4"
    two = roofline_profile(PRESETS["llama-3-70b"], Hardware.of(gpu("h100"), tp=8), _settings())
    # The weights' read halves; each step's 2 all-reduces per layer add their latency.
    ar = 2 * PRESETS["llama-3-70b"].num_layers * ALLREDUCE_LATENCY_S
    assert two.decode_fixed_s - 1e-4 - ar == pytest.approx((one.decode_fixed_s - 1e-4 - ar) / 2)
    assert two.kv_capacity_tokens > 2 * one.kv_capacity_tokens  # weights take less of each


def test_a_model_that_does_not_fit_says_what_to_do():
    with pytest.raises(ValueError, match="--tp"):
        roofline_profile(PRESETS["llama-3-70b"], Hardware.of(gpu("h100")), RooflineSettings())


def test_fp8_weights_halve_the_projection_bytes_and_use_fp8_flops():
    m = PRESETS["llama-3-8b"]
    bf16 = roofline_profile(m, Hardware.of(gpu("h100")), _settings(max_batch_tokens=8192))
    fp8 = roofline_profile(
        m, Hardware.of(gpu("h100"), "fp8"), _settings(max_batch_tokens=8192, weight_dtype="fp8")
    )
    assert fp8.decode_fixed_s < 0.6 * bf16.decode_fixed_s
    assert fp8.decode_per_seq_s == pytest.approx(bf16.decode_per_seq_s / 2, rel=0.01)
    with pytest.raises(ValueError, match="FP8"):
        Hardware.of(gpu("a100"), "fp8")


def test_gpu_table_is_sane():
    assert {
        "h100-sxm",
        "h100-pcie",
        "h200",
        "a100-80g",
        "a100-40g",
        "l40s",
        "l4",
        "a10g",
        "b200",
    } <= set(GPUS)
    for g in GPUS.values():
        assert 100 <= g.bandwidth_gbs <= 10000 and 20 <= g.bf16_tflops <= 5000
        assert g.fp8_tflops is None or g.fp8_tflops == pytest.approx(2 * g.bf16_tflops, rel=0.02)
        # Decode is bandwidth-bound on all of them: FLOP per byte well above 1.
        assert g.bf16_tflops * 1e12 / (g.bandwidth_gbs * 1e9) > 50
    h100, h200, b200 = gpu("H100"), gpu("h200"), gpu("b200")
    assert h100.bf16_tflops == h200.bf16_tflops and h200.bandwidth_gbs > h100.bandwidth_gbs
    assert h200.memory_gb > h100.memory_gb and b200.bandwidth_gbs > h200.bandwidth_gbs
    assert gpu("a100-40g").memory_gb == 40 and gpu("a100-80g").bandwidth_gbs > 2000
    with pytest.raises(ValueError, match="unknown GPU 'v100'.*h100-sxm"):
        gpu("v100")


@pytest.mark.parametrize(
    "name, billions",
    [("llama-3-8b", 8.03), ("llama-3-70b", 70.55), ("llama-3.2-1b", 1.24),
     ("qwen2.5-7b", 7.62), ("qwen2.5-72b", 72.7), ("qwen3-8b", 8.19), ("mistral-7b", 7.25)],
)  # fmt: skip
def test_presets_have_the_published_sizes(name, billions):
    assert PRESETS[name].num_params / 1e9 == pytest.approx(billions, rel=0.005)
    assert model_shape(name.upper()) is PRESETS[name]


def test_every_preset_plans_on_an_h100_node():
    for m in PRESETS.values():
        tp = 1 if m.num_params < 30e9 else 4
        p = roofline_profile(m, Hardware.of(gpu("h100"), tp=tp), RooflineSettings())
        assert p.kv_capacity_tokens > 10_000 and p.prefill_tokens_per_s() > 1000


def _write(tmp_path, cfg: dict, name: str = "config.json"):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / name).write_text(json.dumps(cfg))
    return d


LLAMA_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "attention_bias": False,
    "tie_word_embeddings": False,
}


def test_config_json_parses_like_the_preset(tmp_path):
    shape = shape_from_config(_write(tmp_path, LLAMA_CONFIG))
    assert replace(shape, name="llama-3-8b") == PRESETS["llama-3-8b"]  # head_dim from hidden/heads
    qwen = {k: v for k, v in LLAMA_CONFIG.items() if k != "attention_bias"}
    qwen.update(model_type="qwen2", head_dim=64, num_key_value_heads=32)
    shape = shape_from_config(_write(tmp_path, {"text_config": qwen}) / "config.json")
    assert shape.qkv_bias and shape.head_dim == 64 and shape.num_kv_heads == 32


def test_config_json_errors_name_the_problem(tmp_path):
    missing = {k: v for k, v in LLAMA_CONFIG.items() if k != "vocab_size"}
    with pytest.raises(ValueError, match="lacks vocab_size"):
        shape_from_config(_write(tmp_path, missing))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        shape_from_config(_write(tmp_path, {**LLAMA_CONFIG, "num_local_experts": 8}))
    with pytest.raises(ValueError, match="cannot read"):
        shape_from_config(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="unknown model 'gpt-9'"):
        model_shape("gpt-9")


def test_the_tiny_checkpoints_config_is_read(make_tiny_model):
    shape = shape_from_config(make_tiny_model("qwen2", "tiny", 0))
    assert (shape.num_layers, shape.hidden_size, shape.num_kv_heads) == (2, 128, 2)
    assert shape.qkv_bias and shape.tie_word_embeddings


def _as_measured(p: CapacityProfile) -> CapacityProfile:
    return replace(p, source="measured", measurements={})


@pytest.mark.parametrize(
    "eff", [Efficiency(0.6, 0.35, 2e-4), Efficiency(0.3, 0.8, 0.0), Efficiency(0.5, 0.4, 1e-3, 0.1)]
)
def test_calibration_recovers_known_factors(eff):
    model, hw = PRESETS["llama-3-8b"], Hardware.of(gpu("l40s"))
    measured = _as_measured(
        roofline_profile(model, hw, _settings(efficiency=eff, max_batch_tokens=4096))
    )
    got = calibrate(measured, model, hw, step_overhead_s=eff.step_overhead_s)
    assert got.bandwidth == pytest.approx(eff.bandwidth, rel=1e-9)
    assert got.kv_bandwidth == pytest.approx(eff.kv_bandwidth, rel=1e-9)
    assert got.flops == pytest.approx(eff.flops, rel=1e-9)
    assert got.step_overhead_s == pytest.approx(eff.step_overhead_s, abs=1e-12)
    assert got.source["flops_from"].startswith("prefill")
    # And the calibrated roofline reproduces the measurement.
    again = roofline_profile(model, hw, _settings(efficiency=got, max_batch_tokens=4096))
    assert again.decode_fixed_s == pytest.approx(measured.decode_fixed_s)
    for (t, s), (t0, s0) in zip(again.prefill_points, measured.prefill_points, strict=True):
        assert t == t0 and s == pytest.approx(s0)


def test_calibration_falls_back_to_the_decode_flops_when_prefill_is_bandwidth_bound():
    # Memory so slow that the largest prefill step is still reading weights.
    eff = Efficiency(0.5, 0.4, 1e-4)
    hw = Hardware("slow-memory", 1, 100, 1000, 10)
    measured = _as_measured(roofline_profile(TOY, hw, _settings(efficiency=eff)))
    got = calibrate(measured, TOY, hw, step_overhead_s=1e-4)
    assert got.source["flops_from"] == "decode_per_seq_s"
    assert got.flops == pytest.approx(0.4) and got.bandwidth == pytest.approx(0.5)


def test_calibration_without_an_overhead_puts_the_fixed_cost_on_the_bandwidth():
    eff = Efficiency(0.5, 0.4, 1e-3)
    model, hw = PRESETS["llama-3-8b"], Hardware.of(gpu("l40s"))
    measured = _as_measured(roofline_profile(model, hw, _settings(efficiency=eff)))
    got = calibrate(measured, model, hw)  # overhead unknown: taken as 0
    assert got.step_overhead_s == 0 and got.bandwidth < eff.bandwidth
    assert roofline_profile(model, hw, _settings(efficiency=got)).decode_fixed_s == pytest.approx(
        measured.decode_fixed_s
    )
    with pytest.raises(ValueError, match="leaves nothing"):
        calibrate(measured, model, hw, step_overhead_s=1.0)


def test_prefill_points_cover_the_budget():
    assert prefill_token_counts(8192) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert prefill_token_counts(3000)[-2:] == [2048, 3000]
