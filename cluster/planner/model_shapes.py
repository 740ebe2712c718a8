"""Transformer shapes for the roofline (cluster/planner/roofline.py): `ModelShape`, read from a
Hugging Face config.json (`shape_from_config`) or taken from `PRESETS`, the published configs
of well-known dense models (the numbers are the `config.json` fields of each model's Hugging
Face repository: meta-llama/Meta-Llama-3-8B, Meta-Llama-3-70B, Llama-3.1-8B, Llama-3.2-1B/3B,
Qwen/Qwen2.5-7B/14B/32B/72B-Instruct, Qwen/Qwen3-8B, mistralai/Mistral-7B-v0.3).

Parameter counts follow the Llama family's layout (tandem's engine runs that family): per
layer q/k/v/o projections (+ q/k/v biases for Qwen2), a gated MLP (3 matrices) and two norms;
an embedding table and an LM head (one tensor when tied). Mixture-of-experts configs are
refused: the dense roofline would be wrong for them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FP8_SCALE_BYTES = 4  # tandem's FP8 KV keeps one float32 scale per token, layer, K/V and head


@dataclass(slots=True, frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position: int = 8192

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "max_position",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"model {self.name}: {name} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name}: num_heads must be a multiple of num_kv_heads")

    @property
    def layer_params(self) -> int:
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 3 * h * self.intermediate_size + 2 * h

    @property
    def table_params(self) -> int:
        """One vocab x hidden table (the embedding, or the LM head)."""
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        tables = self.table_params * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.layer_params + tables + self.hidden_size

    def kv_bytes_per_token(self, kv_dtype: str = "auto") -> int:
        """Bytes of one token's K and V over all layers in tandem's cache layout (bf16, or FP8
        with its per-head float32 scales)."""
        n = 2 * self.num_layers * self.num_kv_heads
        if kv_dtype == "fp8_e4m3":
            return n * (self.head_dim + FP8_SCALE_BYTES)
        if kv_dtype == "auto":
            return n * self.head_dim * 2
        raise ValueError(f"kv dtype must be 'auto' (bf16) or 'fp8_e4m3', got {kv_dtype!r}")

    def prefill_flops(self, tokens: int, prompts: int = 1) -> float:
        """FLOPs of a step that prefills `prompts` equal prompts of `tokens` tokens in all:
        every projection once per token, the LM head once per prompt (logits of the last token
        only), and causal attention (QK^T and PV over half the square of each prompt)."""
        per_prompt = tokens / prompts
        attn = self.attention_flops_per_token2() * per_prompt**2 * prompts
        return (
            2 * self.num_layers * self.layer_params * tokens
            + 2 * self.table_params * prompts
            + attn
        )

    def attention_flops_per_token2(self) -> float:
        """Causal attention FLOPs of one prompt per squared token (QK^T and PV, 2 FLOPs per
        multiply-add, over half the square)."""
        return 2 * self.num_layers * self.num_heads * self.head_dim

    def decode_flops_per_seq(self) -> float:
        """FLOPs one sequence adds to a decode step: every projection and the LM head."""
        return 2.0 * (self.num_layers * self.layer_params + self.table_params)


# The config.json fields of each model: name, num_hidden_layers, hidden_size, intermediate_size,
# num_attention_heads, num_key_value_heads, head_dim, vocab_size, tie_word_embeddings, q/k/v
# biases, max_position_embeddings.
_PUBLISHED = (
    ("llama-3-8b", 32, 4096, 14336, 32, 8, 128, 128256, False, False, 8192),
    ("llama-3.1-8b", 32, 4096, 14336, 32, 8, 128, 128256, False, False, 131072),
    ("llama-3-70b", 80, 8192, 28672, 64, 8, 128, 128256, False, False, 8192),
    ("llama-3.2-1b", 16, 2048, 8192, 32, 8, 64, 128256, True, False, 131072),
    ("llama-3.2-3b", 28, 3072, 8192, 24, 8, 128, 128256, True, False, 131072),
    ("qwen2.5-7b", 28, 3584, 18944, 28, 4, 128, 152064, False, True, 32768),
    ("qwen2.5-14b", 48, 5120, 13824, 40, 8, 128, 152064, False, True, 32768),
    ("qwen2.5-32b", 64, 5120, 27648, 40, 8, 128, 152064, False, True, 32768),
    ("qwen2.5-72b", 80, 8192, 29568, 64, 8, 128, 152064, False, True, 32768),
    ("qwen3-8b", 36, 4096, 12288, 32, 8, 128, 151936, False, False, 40960),
    ("mistral-7b", 32, 4096, 14336, 32, 8, 128, 32768, False, False, 32768),
)
PRESETS: dict[str, ModelShape] = {row[0]: ModelShape(*row) for row in _PUBLISHED}


def shape_from_config(path: str | Path, name: str | None = None) -> ModelShape:
    """The shape in a Hugging Face config.json (or a model directory holding one); a
    multimodal config's `text_config` is read. ValueError naming what is missing or wrong."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read model config {path}: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: a config.json is a JSON object")
    cfg = cfg.get("text_config") or cfg
    if any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise ValueError(f"{path}: mixture-of-experts models are not modelled by the roofline")
    need = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
    missing = [k for k in (*need, "vocab_size") if k not in cfg]
    if missing:
        raise ValueError(f"{path}: config.json lacks {', '.join(missing)}")
    heads = int(cfg["num_attention_heads"])
    return ModelShape(
        name=name or path.parent.name or "model",
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        vocab_size=int(cfg["vocab_size"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
        max_position=int(cfg.get("max_position_embeddings") or 8192),
    )


def model_shape(spec: str) -> ModelShape:
    """A preset by name, else a config.json path or model directory."""
    key = spec.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    if Path(spec).exists():
        return shape_from_config(spec)
    raise ValueError(
        f"unknown model {spec!r}: not a preset ({', '.join(PRESETS)}) nor a config.json path"
    )
