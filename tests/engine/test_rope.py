"""The rotary tables tandem computes itself equal the architecture's own HF rotary class bit
for bit, for every architecture and rope variant (Gemma 3: for each layer type, its rope
parameters nested by type), and computing them imports no modeling module (what keeps a
worker's start short)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.models.rope import _ROTARY_CLASSES, hf_rope_tables, rope_tables

REPO = Path(__file__).resolve().parents[2]
CONFIG_CLASSES = {
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Phi3ForCausalLM": "Phi3Config",
    "MixtralForCausalLM": "MixtralConfig",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
}
VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "theta-1e6": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    # The class rescales these with the sequence length: they go through the class itself.
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}
# Phi3Config accepts only these rope types (and longrope: test_longrope_*).
PHI3_VARIANTS = ("default", "theta-1e6")
GEMMA3 = "Gemma3ForCausalLM"  # rope parameters per layer type: test_gemma3_tables_*
CASES = [
    (arch, variant)
    for arch in sorted(_ROTARY_CLASSES)
    for variant in sorted(VARIANTS)
    if (arch != "Phi3ForCausalLM" or variant in PHI3_VARIANTS) and arch != GEMMA3
]
# engine.config refuses the length-dependent variants for Gemma 3 (test_gemma3.py).
GEMMA3_VARIANTS = sorted(v for v in VARIANTS if v != "dynamic")
# Phi-3.5-mini's shape of longrope, small: per-frequency short and long factors (head_dim 32).
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.05 * i for i in range(16)],
    "long_factor": [1.5 + 0.5 * i for i in range(16)],
    "original_max_position_embeddings": 128,
}


def _config(architecture: str, rope: dict, head_dim: int | None, max_position=1024, **extra):
    import transformers

    cls = getattr(transformers, CONFIG_CLASSES[architecture])
    if head_dim is not None:
        extra["head_dim"] = head_dim
    return cls(
        hidden_size=96,
        num_attention_heads=3,
        num_key_value_heads=1,
        max_position_embeddings=max_position,
        rope_parameters=dict(rope),
        **extra,
    )


@pytest.mark.parametrize(("architecture", "variant"), CASES)
def test_tables_equal_the_hf_class_bit_for_bit(architecture, variant):
    # qwen3 states its own; so must mixtral for yarn (its config's head_dim None is not
    # transformers' fallback there)
    head_dim = 64 if architecture in ("Qwen3ForCausalLM", "MixtralForCausalLM") else None
    cfg = _config(architecture, VARIANTS[variant], head_dim)
    dim = head_dim or 32
    cos, sin = rope_tables(cfg, architecture, 1024, dim)
    ref_cos, ref_sin = hf_rope_tables(cfg, architecture, 1024, dim)
    assert cos.shape == ref_cos.shape == (1024, dim) and cos.dtype == torch.float32
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    if variant not in ("default", "theta-1e6", "dynamic"):  # dynamic: no rescale within 1024
        plain = _config(architecture, VARIANTS["default"], head_dim)
        assert not torch.equal(cos, rope_tables(plain, architecture, 1024, dim)[0])


def test_tables_import_no_modeling_module():
    code = (
        "import sys; from transformers import LlamaConfig;"
        "from engine.models.rope import rope_tables;"
        "cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=64);"
        "rope_tables(cfg, 'LlamaForCausalLM', 64, 32);"
        "heavy = ('transformers.models.llama.modeling_llama', 'transformers.modeling_utils');"
        "print([m for m in heavy if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("architecture", ["Phi3ForCausalLM", "LlamaForCausalLM"])
def test_longrope_tables_are_short_below_the_original_context_and_long_from_it(architecture):
    """What `generate` computes at each position while the prompt fits the original context
    (128 here): the class's short-factor rows below it, its long-factor rows from it on."""
    cfg = _config(architecture, LONGROPE, None)
    if architecture == "Phi3ForCausalLM":  # its own top-level field overrides rope_parameters'
        cfg = _config(architecture, LONGROPE, None, original_max_position_embeddings=128)
    cos, sin = rope_tables(cfg, architecture, 1024, 32)
    short_cos, short_sin = hf_rope_tables(cfg, architecture, 128, 32)
    long_cos, long_sin = hf_rope_tables(cfg, architecture, 1024, 32)
    assert cos.shape == (1024, 32) and cos.dtype == torch.float32
    assert torch.equal(cos[:128], short_cos) and torch.equal(sin[:128], short_sin)
    assert torch.equal(cos[128:], long_cos[128:]) and torch.equal(sin[128:], long_sin[128:])
    assert not torch.equal(short_cos[1:], long_cos[1:128])  # the factors differ: both matter


def test_longrope_within_the_original_context_is_the_class_itself():
    cfg = _config("Phi3ForCausalLM", LONGROPE, None, 128, original_max_position_embeddings=128)
    cos, sin = rope_tables(cfg, "Phi3ForCausalLM", 128, 32)
    ref_cos, ref_sin = hf_rope_tables(cfg, "Phi3ForCausalLM", 128, 32)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def _gemma3_config(full: dict, sliding: dict):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        hidden_size=96,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=32,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=1024,
        rope_parameters={"full_attention": dict(full), "sliding_attention": dict(sliding)},
    )


@pytest.mark.parametrize("variant", GEMMA3_VARIANTS)
def test_gemma3_tables_equal_the_hf_class_per_layer_type(variant):
    """Full layers with each variant, sliding layers with the default rope of another base:
    each type's tables are the class's for that type, and the two differ."""
    cfg = _gemma3_config(VARIANTS[variant], {"rope_type": "default", "rope_theta": 777.0})
    tables = {}
    for layer_type in ("full_attention", "sliding_attention"):
        cos, sin = rope_tables(cfg, GEMMA3, 1024, 32, layer_type)
        ref_cos, ref_sin = hf_rope_tables(cfg, GEMMA3, 1024, 32, layer_type)
        assert cos.shape == (1024, 32) and cos.dtype == torch.float32
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin), layer_type
        tables[layer_type] = cos
    assert not torch.equal(tables["full_attention"], tables["sliding_attention"])
