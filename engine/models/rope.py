"""Rotary position embedding tables, equal bit for bit to the architecture's own Hugging Face
rotary class, so every rope variant in a config (default, linear, llama3, yarn, ...) matches the
reference exactly. Tables are built once for all positions, in float32, as HF does.

Where the config names its rope in transformers 5's form (`rope_parameters`) and the variant's
frequencies do not change with the sequence length, the tables are computed here with the
class's own arithmetic: its inverse frequencies (the default formula, or transformers'
`ROPE_INIT_FUNCTIONS` for the named variant), then `position * inv_freq`, both halves, cos
and sin times the variant's attention scaling. That spares each worker process the import of
the architecture's modeling module (~1.8 s of CPU on a 2-core box, on every worker start);
tests/engine/test_rope.py holds the two bit-equal for every architecture and variant. Any other
config (dynamic or longrope, whose forward rescales by length; transformers 4's keys) is built
by the HF class itself.

longrope (Phi-3.5 style) picks its frequencies per forward call: the short factors while the
call's last position is below `original_max_position_embeddings`, the long ones past it, for
every position of the call. A sequence that outgrows the original context is thus computed
with the long factors at all its positions (Phi-3's `generate` recomputes its cache at the
switch), which per-position tables cannot be; engine.config refuses a context window past the
original context for longrope, so only the short rows (`_longrope_tables`) are ever read.

Gemma 3 nests its rope parameters by layer type (`rope_parameters["sliding_attention"]`: the
local base, `["full_attention"]`: the global base with the model's scaling) and its rotary class
takes the layer type per call; `layer_type` selects one set (engine.config refuses the
length-dependent variants for it)."""

from __future__ import annotations

import importlib

import torch

_ROTARY_CLASSES = {
    "LlamaForCausalLM": ("llama", "LlamaRotaryEmbedding"),
    "MistralForCausalLM": ("mistral", "MistralRotaryEmbedding"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2RotaryEmbedding"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3RotaryEmbedding"),
    "Phi3ForCausalLM": ("phi3", "Phi3RotaryEmbedding"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3RotaryEmbedding"),
    "MixtralForCausalLM": ("mixtral", "MixtralRotaryEmbedding"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeRotaryEmbedding"),
}
# Variants whose forward changes the frequencies with the sequence length (HF's
# `dynamic_rope_update`): the class builds those.
_LENGTH_DEPENDENT = ("dynamic", "longrope")


def rope_tables(
    hf_config, architecture: str, max_position: int, head_dim: int, layer_type: str | None = None
):
    """(cos, sin) of shape [max_position, head_dim] in float32; with `layer_type`, those of the
    layers of that type (rope parameters nested by layer type: Gemma 3)."""
    params = getattr(hf_config, "rope_parameters", None)
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default") if isinstance(params, dict) else None
    if rope_type is not None and "longrope" in rope_type and layer_type is None:
        return _longrope_tables(hf_config, architecture, max_position, head_dim)
    if rope_type is None or any(t in rope_type for t in _LENGTH_DEPENDENT):
        return hf_rope_tables(hf_config, architecture, max_position, head_dim, layer_type)
    inv_freq, scaling = _inverse_frequencies(hf_config, rope_type, layer_type)
    positions = torch.arange(max_position, dtype=torch.long)[:, None].float()
    freqs = positions * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).contiguous(), (emb.sin() * scaling).contiguous()


def _inverse_frequencies(
    hf_config, rope_type: str, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """The rotary class's `rope_init_fn(config)`: its default formula, or the variant's (for
    one layer type's parameters, where they are nested so)."""
    by_type = {} if layer_type is None else {"layer_type": layer_type}
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        return ROPE_INIT_FUNCTIONS[rope_type](hf_config, **by_type)
    params = hf_config.rope_parameters
    base = (params if layer_type is None else params[layer_type])["rope_theta"]
    cfg = hf_config
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def _longrope_tables(hf_config, architecture: str, max_position: int, head_dim: int):
    """Rows below the original context from a forward that stays inside it (short factors:
    what transformers computes for a sequence that fits it), the rest, never read while the
    window stays inside it (see the module docstring), from one over every position."""
    original = hf_config.rope_parameters.get("original_max_position_embeddings") or getattr(
        hf_config, "original_max_position_embeddings", max_position
    )
    short = min(int(original), max_position)
    cos, sin = hf_rope_tables(hf_config, architecture, short, head_dim)
    if short == max_position:
        return cos, sin
    long_cos, long_sin = hf_rope_tables(hf_config, architecture, max_position, head_dim)
    return torch.cat((cos, long_cos[short:])), torch.cat((sin, long_sin[short:]))


def hf_rope_tables(
    hf_config, architecture: str, max_position: int, head_dim: int, layer_type: str | None = None
):
    """The tables from the architecture's HF rotary class (the reference); `layer_type` is
    passed to a class that takes one (Gemma 3's)."""
    module, name = _ROTARY_CLASSES[architecture]
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    with torch.device("cpu"):
        rotary = getattr(mod, name)(config=hf_config)
    positions = torch.arange(max_position, dtype=torch.long)[None, :]
    x = torch.zeros(1, 1, head_dim, dtype=torch.float32)
    by_type = () if layer_type is None else (layer_type,)
    with torch.no_grad():
        cos, sin = rotary(x, positions, *by_type)
    return cos[0].float().contiguous(), sin[0].float().contiguous()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin`, bit for bit, without building rotate_half(x): each
    product is rounded to x's dtype and then added, as there, and `a + (-b)` is exactly
    `a - b`. Two fewer passes over x (no negation, no concatenation): on an H100's 8k-token
    prefill they were a third of RoPE's time. x: [..., head_dim]; cos/sin broadcast to it."""
    half = x.shape[-1] // 2
    out = x * cos
    prod = torch.empty_like(out)
    torch.mul(x[..., half:], sin[..., :half], out=prod[..., :half])
    torch.mul(x[..., :half], sin[..., half:], out=prod[..., half:])
    out[..., :half] -= prod[..., :half]
    out[..., half:] += prod[..., half:]
    return out


def apply_rope(q, k, cos, sin):
    """q/k: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] already in q's dtype."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return rotate(q, cos, sin), rotate(k, cos, sin)
