"""The rotary tables tandem computes itself equal the architecture's own HF rotary class bit
for bit, for every architecture and rope variant, and computing them imports no modeling
module (what keeps a worker's start short)."""

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


def _config(architecture: str, rope: dict, head_dim: int | None):
    import transformers

    cls = getattr(transformers, CONFIG_CLASSES[architecture])
    extra = {} if head_dim is None else {"head_dim": head_dim}
    return cls(
        hidden_size=96,
        num_attention_heads=3,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        rope_parameters=dict(rope),
        **extra,
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("architecture", sorted(_ROTARY_CLASSES))
def test_tables_equal_the_hf_class_bit_for_bit(architecture, variant):
    head_dim = 64 if architecture == "Qwen3ForCausalLM" else None  # qwen3 states its own
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
