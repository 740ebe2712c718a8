"""The roofline of mixture-of-experts models: a made-up MoE shape counted by hand; the Mixtral and
Qwen3-MoE presets against their published sizes; their config.json read like the engine reads
it, and the MoE families the engine refuses refused by name; the decode step's straight line
against the exact expected expert bytes; and `tandem plan` on Mixtral."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from test_plan_cli import _plan

from bench.capacity_profile import CapacityProfile
from cluster.planner.gpus import gpu
from cluster.planner.model_shapes import (
    MIXTRAL,
    PRESETS,
    QWEN3_MOE,
    UNSERVED_MOE,
    ModelShape,
    shape_from_config,
)
from cluster.planner.roofline import (
    Efficiency,
    Hardware,
    RooflineSettings,
    allreduce_s,
    calibrate,
    decode_weight_bytes,
    expected_decode_weight_bytes,
    roofline_profile,
    step_weight_bytes,
    weight_memory_bytes,
)

# 3 layers, hidden 64, dense MLP 128 (layer 1), 4 experts of 32, top 2; 4 heads of 16 (2 KV).
TOY = ModelShape("toy-moe", 3, 64, 128, 4, 2, 16, 100, False, False, 8192, 4, 2, 32, (1,))
ATTN = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 64  # q, k, v, o and the two norms
DENSE_MLP, EXPERT, ROUTER, TABLE = 3 * 64 * 128, 3 * 64 * 32, 64 * 4, 100 * 64
ALL_EXPERTS = 2 * 4 * EXPERT  # every expert of the 2 sparse layers
EFF = Efficiency(0.5, 0.25, 1e-4)


def test_toy_moe_counts_by_hand():
    assert TOY.num_sparse_layers == 2
    assert TOY.stack_params == 3 * ATTN + DENSE_MLP + 2 * (4 * EXPERT + ROUTER)
    assert TOY.active_stack_params == 3 * ATTN + DENSE_MLP + 2 * (2 * EXPERT + ROUTER)
    assert TOY.num_params == TOY.stack_params + 2 * TABLE + 64
    assert TOY.active_params == TOY.num_params - 2 * 2 * EXPERT
    # A token runs its 2 experts and the router: FLOPs follow the active params.
    attn2 = 2 * 3 * 4 * 16
    assert TOY.prefill_flops(32) == 2 * TOY.active_stack_params * 32 + 2 * TABLE + attn2 * 32**2
    assert TOY.decode_flops_per_seq() == 2 * (TOY.active_stack_params + TABLE)
    # Experts change neither the KV nor the all-reduces (one per MoE block, as per dense MLP).
    dense = ModelShape("toy", 3, 64, 128, 4, 2, 16, 100)
    assert TOY.kv_bytes_per_token() == dense.kv_bytes_per_token()
    hw = Hardware("toy-gpu", 1000, 100, 1, 10, gpus=2)
    assert allreduce_s(TOY, hw) == allreduce_s(dense, hw)


def test_toy_moe_bytes_by_hand():
    # Every expert in memory and in a prefill step; the routers stay bf16 under fp8 weights.
    assert step_weight_bytes(TOY, "bf16") == 2 * (TOY.stack_params + TABLE)
    routers = 2 * ROUTER
    assert step_weight_bytes(TOY, "fp8") == TOY.stack_params - routers + 2 * routers + 2 * TABLE
    assert weight_memory_bytes(TOY, "bf16") == step_weight_bytes(TOY, "bf16") + 2 * TABLE
    # A decode step of B sequences reads on average 4 x (1 - (1 - 2/4)^B) experts per layer.
    rest = step_weight_bytes(TOY, "bf16") - 2 * ALL_EXPERTS
    for b in (1, 2, 5):
        expected = rest + 2 * ALL_EXPERTS * (1 - 0.5**b)
        assert expected_decode_weight_bytes(TOY, "bf16", b) == pytest.approx(expected)


@pytest.mark.parametrize(
    "name, total, active",
    [("mixtral-8x7b", 46.7, 12.9), ("qwen3-30b-a3b", 30.5, 3.3)],
)
def test_moe_presets_have_the_published_sizes(name, total, active):
    m = PRESETS[name]
    assert m.num_params / 1e9 == pytest.approx(total, rel=0.005)
    assert m.active_params / 1e9 == pytest.approx(active, rel=0.03)
    # Qwen3-30B-A3B's card: 29.9B parameters without the embedding and the LM head.
    if name == "qwen3-30b-a3b":
        assert (m.num_params - 2 * m.table_params) / 1e9 == pytest.approx(29.9, rel=0.005)


def _write(tmp_path, cfg: dict):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


# The published config.json fields (those the roofline reads).
MIXTRAL_CONFIG = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}
QWEN3_MOE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_hidden_layers": 48,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def test_moe_config_json_parses_like_the_preset(tmp_path):
    mixtral = shape_from_config(_write(tmp_path, MIXTRAL_CONFIG))
    assert replace(mixtral, name="mixtral-8x7b") == PRESETS["mixtral-8x7b"]
    qwen = shape_from_config(_write(tmp_path, QWEN3_MOE_CONFIG))
    assert replace(qwen, name="qwen3-30b-a3b") == PRESETS["qwen3-30b-a3b"]


def test_qwen3_moe_dense_layers_follow_the_config(tmp_path):
    # Layer i is sparse unless listed in mlp_only_layers, and when (i + 1) % step == 0.
    cfg = {**QWEN3_MOE_CONFIG, "num_hidden_layers": 6, "mlp_only_layers": [3]}
    cfg["decoder_sparse_step"] = 2
    shape = shape_from_config(_write(tmp_path, cfg))
    assert shape.dense_layers == (0, 2, 3, 4) and shape.num_sparse_layers == 2
    dense_mlp = 3 * 2048 * 6144
    assert shape.stack_params == 6 * shape.attention_params + 4 * dense_mlp + 2 * (
        128 * shape.expert_params + shape.router_params
    )
    # transformers 5 writes the expert count as num_local_experts.
    alias = {k: v for k, v in QWEN3_MOE_CONFIG.items() if k != "num_experts"}
    alias["num_local_experts"] = 128
    assert shape_from_config(_write(tmp_path, alias)).num_experts == 128
    # No expert in any layer: the dense shape.
    none = shape_from_config(_write(tmp_path, {**QWEN3_MOE_CONFIG, "num_experts": 0}))
    assert not none.is_moe and none.num_params == 48 * none.layer_params + 2 * 151936 * 2048 + 2048
    with pytest.raises(ValueError, match="lacks moe_intermediate_size"):
        bad = {k: v for k, v in QWEN3_MOE_CONFIG.items() if k != "moe_intermediate_size"}
        shape_from_config(_write(tmp_path, bad))
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        shape_from_config(_write(tmp_path, {**QWEN3_MOE_CONFIG, "decoder_sparse_step": 0}))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_the_tiny_moe_checkpoints_match_the_engine(make_tiny_model, arch):
    from engine.config import ModelConfig

    path = make_tiny_model(arch, "tiny", 0)
    shape, engine = shape_from_config(path), ModelConfig.from_pretrained(path)
    moe = engine.moe
    assert (shape.num_experts, shape.experts_per_token) == (moe.num_experts, moe.top_k)
    assert shape.expert_intermediate_size == moe.intermediate_size
    sparse = tuple(i not in shape.dense_layers for i in range(shape.num_layers))
    assert sparse == moe.sparse_layers
    # The engine also counts Qwen3's per-head q/k norms, which the roofline leaves out.
    qk_norms = 2 * engine.head_dim * engine.num_layers if engine.qk_norm else 0
    assert shape.num_params + qk_norms == engine.num_params()


def test_the_planner_refuses_what_the_engine_refuses():
    from engine.config import MOE_ARCHITECTURES
    from engine.config import UNSERVED_MOE as ENGINE_UNSERVED

    assert UNSERVED_MOE == ENGINE_UNSERVED and {MIXTRAL, QWEN3_MOE} == set(MOE_ARCHITECTURES)


@pytest.mark.parametrize(
    "cfg, message",
    [
        (
            {"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 60,
             "shared_expert_intermediate_size": 5632},
            "Qwen2MoeForCausalLM is not served by tandem: its shared expert",
        ),
        (  # no `architectures`: the model_type names it
            {"model_type": "qwen2_moe", "num_experts": 60},
            "Qwen2MoeForCausalLM is not served by tandem: its shared expert",
        ),
        ({"architectures": ["OlmoeForCausalLM"], "num_experts": 64}, "OlmoeForCausalLM .*clip_qkv"),
        (
            {"architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 256,
             "n_shared_experts": 1},
            "DeepseekV3ForCausalLM has a shared expert \\(n_shared_experts\\)",
        ),
        (
            {"architectures": ["DeepseekV2ForCausalLM"], "n_routed_experts": 64},
            "DeepseekV2ForCausalLM \\(n_routed_experts\\) is not served",
        ),
        (
            {"architectures": ["PhimoeForCausalLM"], "num_local_experts": 16},
            "PhimoeForCausalLM \\(num_local_experts\\) is not served",
        ),
        (  # a served family with a shared expert still computes something the engine does not
            {**QWEN3_MOE_CONFIG, "shared_expert_intermediate_size": 512},
            "Qwen3MoeForCausalLM has a shared expert",
        ),
    ],
)  # fmt: skip
def test_unserved_moe_families_are_refused_by_name(tmp_path, cfg, message):
    base = {k: v for k, v in MIXTRAL_CONFIG.items() if k not in ("architectures", "model_type")}
    base.pop("num_local_experts")
    with pytest.raises(ValueError, match=f"mixture-of-experts architecture {message}"):
        shape_from_config(_write(tmp_path, {**base, **cfg}))


def _line_over_exact(model, dtype, max_batch):
    fixed, per_seq, tangent = decode_weight_bytes(model, dtype, max_batch)
    return tangent, [
        (fixed + per_seq * b) / expected_decode_weight_bytes(model, dtype, b) - 1
        for b in range(1, max_batch + 1)
    ]


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("max_batch", [1, 8, 64, 256])
def test_the_decode_line_never_under_estimates_the_expected_bytes(name, dtype, max_batch):
    m = PRESETS[name]
    tangent, over = _line_over_exact(m, dtype, max_batch)
    assert 1 <= tangent <= max_batch
    assert min(over) >= -1e-12  # at every batch the profile serves (rounding aside)
    # No worse on average than reading every expert at every batch (the all-expert limit).
    every = [
        step_weight_bytes(m, dtype) / expected_decode_weight_bytes(m, dtype, b) - 1
        for b in range(1, max_batch + 1)
    ]
    assert sum(over) <= sum(every) * (1 + 1e-12)
    if max_batch == 1:  # one sequence: exact
        assert over[0] == pytest.approx(0, abs=1e-12)


def test_the_decode_line_has_the_least_mean_over_estimate_of_the_tangents():
    """The closed-form tangent point beats its neighbours (the mean is convex in t)."""
    m, dtype, n = PRESETS["qwen3-30b-a3b"], "bf16", 64
    rest = step_weight_bytes(m, dtype) - m.expert_stack_params * 2
    experts, q = m.expert_stack_params * 2, 1 - 8 / 128

    def mean_over(t):
        slope = -experts * q**t * math.log(q)
        fixed = rest + experts * (1 - q**t) - t * slope
        exact = [expected_decode_weight_bytes(m, dtype, b) for b in range(1, n + 1)]
        return sum((fixed + slope * b) / x - 1 for b, x in enumerate(exact, 1)) / n

    tangent, over = _line_over_exact(m, dtype, n)
    assert sum(over) / n == pytest.approx(mean_over(tangent))
    for t in (tangent - 2, tangent - 0.2, tangent + 0.2, tangent + 2):
        assert mean_over(t) > mean_over(tangent)


def test_the_error_bounds_the_module_doc_states():
    mixtral = _line_over_exact(PRESETS["mixtral-8x7b"], "bf16", 256)[1]
    qwen = _line_over_exact(PRESETS["qwen3-30b-a3b"], "bf16", 256)[1]
    assert max(mixtral[15:]) < 0.011 and 2.6 < mixtral[0] < 2.7  # 1% from B=16, 3.7x at B=1
    assert max(qwen[63:]) < 0.014 and 0.5 < qwen[15] < 0.52 and 8.8 < qwen[0] < 8.95
    _, qwen64 = _line_over_exact(PRESETS["qwen3-30b-a3b"], "bf16", 64)
    assert sum(qwen64) / 64 == pytest.approx(0.28, abs=0.005)


def test_the_moe_profile_bounds_the_exact_decode_step():
    m, hw = PRESETS["qwen3-30b-a3b"], Hardware.of(gpu("h100"))
    s = RooflineSettings(efficiency=EFF, max_num_seqs=64)
    p = roofline_profile(m, hw, s)
    bw, flops = hw.bytes_per_s * EFF.bandwidth, hw.flops * EFF.flops
    for b in range(1, 65):
        exact = (
            expected_decode_weight_bytes(m, "bf16", b) / bw
            + EFF.step_overhead_s
            + b * m.decode_flops_per_seq() / flops
        )
        assert p.decode_fixed_s + p.decode_per_seq_s * b >= exact * (1 - 1e-12)
    # Prefill reads every expert but computes only the top-k.
    t, seconds = p.prefill_points[0]
    memory = (step_weight_bytes(m, "bf16") + t * m.kv_bytes_per_token()) / bw
    assert seconds == pytest.approx(max(memory, m.prefill_flops(t) / flops) + EFF.step_overhead_s)
    moe = p.measurements["roofline"]["moe"]
    assert moe["active_params"] == m.active_params and 1 < moe["tangent_batch"] < 64
    assert moe["over_estimate_at_batch_1"] > moe["over_estimate_at_max_num_seqs"] > 0


@pytest.mark.parametrize("eff", [Efficiency(0.6, 0.35, 2e-4), Efficiency(0.5, 0.4, 1e-3, 0.1)])
def test_calibration_recovers_known_factors_on_a_moe(eff):
    model, hw = PRESETS["qwen3-30b-a3b"], Hardware.of(gpu("h100"))
    s = RooflineSettings(efficiency=eff, max_num_seqs=32, max_batch_tokens=8192)
    measured = replace(roofline_profile(model, hw, s), source="measured", measurements={})
    got = calibrate(measured, model, hw, step_overhead_s=eff.step_overhead_s)
    assert got.bandwidth == pytest.approx(eff.bandwidth, rel=1e-9)
    assert got.kv_bandwidth == pytest.approx(eff.kv_bandwidth, rel=1e-9)
    assert got.flops == pytest.approx(eff.flops, rel=1e-9)


def test_calibration_from_decode_takes_off_the_line_s_bytes_per_sequence():
    eff, hw = Efficiency(0.5, 0.4, 1e-4), Hardware("slow-memory", 1, 100, 1000, 10)
    s = RooflineSettings(efficiency=eff, max_num_seqs=8, max_batch_tokens=64)
    measured = replace(roofline_profile(TOY, hw, s), source="measured", measurements={})
    assert decode_weight_bytes(TOY, "bf16", 8)[1] > 0
    got = calibrate(measured, TOY, hw, step_overhead_s=1e-4)
    assert got.source["flops_from"] == "decode_per_seq_s"
    assert got.flops == pytest.approx(0.4) and got.bandwidth == pytest.approx(0.5)


def test_plan_mixtral_produces_a_profile(capsys, tmp_path):
    out_path = tmp_path / "p.json"
    rc, out, _ = _plan(
        capsys, "--model", "mixtral-8x7b", "--gpu", "h100", "--tp", "2", "--prompt", "1000",
        "--output", "100", "--out", str(out_path),
    )  # fmt: skip
    assert rc == 0 and "mixtral-8x7b on h100-sxm x2" in out
    profile = CapacityProfile.load(out_path)
    expected = roofline_profile(
        PRESETS["mixtral-8x7b"], Hardware.of(gpu("h100"), tp=2), RooflineSettings()
    )
    assert profile.to_dict() == CapacityProfile.from_dict(expected.to_dict()).to_dict()
    assert profile.gpus_per_worker == 2 and profile.kv_capacity_tokens > 100_000
    # From its config.json, and on one H100 at fp8 (47 GB of weights).
    config = _write(tmp_path, MIXTRAL_CONFIG)
    rc, out, _ = _plan(
        capsys, "--model-config", str(config), "--gpu", "h100", "--weight-dtype", "fp8"
    )
    assert rc == 0 and "weights 47.0 GB (fp8)" in out


def test_plan_refuses_mixtral_on_one_h100_at_bf16(capsys):
    rc, _, err = _plan(capsys, "--model", "mixtral-8x7b", "--gpu", "h100")
    assert rc == 2 and err.startswith("tandem plan: mixtral-8x7b does not fit h100-sxm")
    assert "93.4 GB of weights" in err and "--tp" in err and "fp8" in err


def test_list_names_the_moe_presets(capsys):
    rc, out, _ = _plan(capsys, "--list-known")
    assert rc == 0 and "8 experts (top 2), 12.88 B active" in out and "qwen3-30b-a3b" in out
