"""Model and engine configuration.

`ModelConfig` reads a Hugging Face config.json through transformers' AutoConfig (the reader the
router shares, engine/model_info.py, as it shares the context-window rule), so checkpoints
written by transformers 4.x (`rope_scaling`, `rope_theta`) and 5.x (`rope_parameters`) both
load; the rotary tables themselves come from the architecture's own HF rotary class (see
`engine.models.rope`), which keeps every rope variant token-exact with the reference.
What a decoder would compute differently from transformers is refused here, the config field
named (`_check_computable`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.gguf_file import architecture_of, is_gguf
from engine.model_info import context_window, eos_token_ids, load_hf_config
from engine.quantization.checkpoint import read_fp8_checkpoint

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)
GEMMA3 = "Gemma3ForCausalLM"  # Gemma 3's text decoder: its own layer (engine/models/gemma.py)
# transformers' per-layer attention types (`config.layer_types`) the engine computes: a layer
# of the first attends within `sliding_window` keys, one of the second to every key.
SLIDING, FULL = "sliding_attention", "full_attention"
# Architectures whose checkpoints store q/k/v and gate/up already fused, under the names the
# engine's parameters have (`qkv_proj`, `gate_up_proj`): engine/loader.py reads those whole.
PREFUSED_CHECKPOINTS = ("Phi3ForCausalLM",)
# Sparse mixture-of-experts decoders (engine/models/moe.py): Mistral's attention with experts
# in every layer; Qwen3's attention (per-head q/k norms) with experts where the config says.
MIXTRAL, QWEN3_MOE = "MixtralForCausalLM", "Qwen3MoeForCausalLM"
MOE_ARCHITECTURES = (MIXTRAL, QWEN3_MOE)
# Mixture-of-experts families whose layers compute something the MoE decoder does not: refused
# with the reason rather than as an unknown architecture.
UNSERVED_MOE = {
    "OlmoeForCausalLM": "its q/k norms span all heads at once and it clips q/k/v (clip_qkv)",
    "Qwen2MoeForCausalLM": "its shared expert and that expert's sigmoid gate are not computed",
}

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(slots=True, frozen=True)
class MoEConfig:
    """A sparse mixture-of-experts MLP (engine/models/moe.py): a router picks `top_k` of
    `num_experts` SwiGLU experts per token, weighted by their softmax probabilities."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    # The top-k probabilities divided by their sum (Mixtral always; Qwen3-MoE: norm_topk_prob).
    renormalize: bool
    # Qwen3-MoE rounds the routing weights to the activation dtype before weighting an
    # expert's output; Mixtral weights in fp32 and rounds the product.
    weights_in_activation_dtype: bool
    # Per decoder layer: the experts (True) or the dense MLP of `intermediate_size` (Qwen3-MoE's
    # `mlp_only_layers`, `decoder_sparse_step`).
    sparse_layers: tuple[bool, ...]


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


@dataclass(slots=True, frozen=True)
class ModelConfig:
    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    # The attention window (keys a query sees, itself included; None: all): every layer's, or
    # with `layer_types` the sliding layers' only (`window_of`).
    sliding_window: int | None
    # Each layer's type (SLIDING or FULL) where they differ (Gemma 3: window and rotary table
    # by type); empty where every layer is alike.
    layer_types: tuple[str, ...]
    attention_scale: float  # the softmax scale of q.k
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    hf_config: Any = field(compare=False, repr=False)
    # The FP8 layout config.json's quantization_config declares (None: full precision).
    fp8_checkpoint: Any = field(default=None, compare=False)
    moe: MoEConfig | None = None  # the experts of a mixture-of-experts architecture

    def __post_init__(self) -> None:
        if self.architecture in UNSERVED_MOE:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported: "
                f"{UNSERVED_MOE[self.architecture]}"
            )
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ModelConfig:
        path = str(path)
        gguf = is_gguf(path)
        if not gguf and not Path(path, "config.json").is_file():
            raise FileNotFoundError(
                f"{path} has no config.json (a local HF model directory, or a .gguf file)"
            )
        hf = load_hf_config(path)
        arch = architecture_of(hf)
        _check_computable(hf, arch)
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        gemma = arch == GEMMA3
        # Gemma scales by query_pre_attn_scalar, which its checkpoints set apart from head_dim.
        scale = (hf.query_pre_attn_scalar if gemma else head_dim) ** -0.5
        qkv_bias = arch == "Qwen2ForCausalLM" or bool(getattr(hf, "attention_bias", False))
        o_bias = arch != "Qwen2ForCausalLM" and bool(getattr(hf, "attention_bias", False))
        sliding, layer_types = _windows(hf, arch)
        eos = eos_token_ids(path, hf)
        fp8 = (
            None if gguf else read_fp8_checkpoint(json.loads(Path(path, "config.json").read_text()))
        )
        moe = _moe_config(hf, arch)
        if moe is not None and fp8 is not None:
            raise ValueError(
                f"{arch}: config.json's quantization_config declares an FP8 checkpoint; FP8 "
                "checkpoints of mixture-of-experts models are not supported (serve the "
                "full-precision one: quantization 'fp8' or 'int8' quantizes its experts at load)"
            )
        return cls(
            path=path,
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=arch in ("Qwen3ForCausalLM", GEMMA3, QWEN3_MOE),
            sliding_window=sliding,
            layer_types=layer_types,
            attention_scale=float(scale),
            eos_token_ids=eos,
            bos_token_id=getattr(hf, "bos_token_id", None),
            hf_config=hf,
            fp8_checkpoint=fp8,
            moe=moe,
        )

    def window_of(self, layer: int) -> int | None:
        """The attention window of decoder layer `layer` (None: the layer sees every key)."""
        if self.layer_types and self.layer_types[layer] != SLIDING:
            return None
        return self.sliding_window

    @property
    def prefused_checkpoint(self) -> bool:
        """The checkpoint holds `qkv_proj` / `gate_up_proj` whole (Phi-3), not their parts."""
        return self.architecture in PREFUSED_CHECKPOINTS

    def context_window(self, max_model_len: int | None) -> int:
        """The context window served: max_position_embeddings, lowered to `max_model_len` when
        set; the router computes its limit with the same function. A longrope model's window
        must stay inside its original context (`_check_longrope_window`)."""
        window = context_window(self.hf_config, max_model_len, self.path)
        _check_longrope_window(self.hf_config, self.architecture, window)
        return window

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        if self.architecture == GEMMA3:  # its pre- and post-feedforward norms
            per_layer += 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        total = self.num_layers * per_layer + emb + h
        if self.moe is not None:  # experts and a router instead of the dense MLP
            experts = self.moe.num_experts * (3 * h * self.moe.intermediate_size + h)
            total += sum(self.moe.sparse_layers) * (experts - 3 * h * i)
        return total


def _moe_config(hf: Any, arch: str) -> MoEConfig | None:
    """The experts of a mixture-of-experts config as transformers builds them (None for a
    dense architecture); ValueError naming the field it could not compute."""
    if arch not in MOE_ARCHITECTURES:
        return None
    n, k, layers = hf.num_experts, hf.num_experts_per_tok, hf.num_hidden_layers
    if arch == MIXTRAL:
        sparse = (True,) * layers
        moe = MoEConfig(n, k, hf.intermediate_size, True, False, sparse)
    else:
        step = hf.decoder_sparse_step
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(
                f"{arch}: decoder_sparse_step is {step!r}; only a positive layer interval is "
                "supported"
            )
        dense = set(hf.mlp_only_layers or ())
        sparse = tuple(i not in dense and n > 0 and (i + 1) % step == 0 for i in range(layers))
        norm = bool(hf.norm_topk_prob)
        moe = MoEConfig(n, k, hf.moe_intermediate_size, norm, True, sparse)
    if any(sparse) and not 1 <= k <= n:
        raise ValueError(
            f"{arch}: num_experts_per_tok is {k}; between 1 and the {n} experts is supported"
        )
    return moe


def _windows(hf: Any, arch: str) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) as transformers attends: Gemma 3 per layer; Qwen2/Qwen3
    only with `use_sliding_window`, and then only on the layers `layer_types` marks sliding
    (from `max_window_layers` on: none of them when it is the layer count); every layer of
    the others. `layer_types` is left empty when every layer attends alike."""
    sliding = getattr(hf, "sliding_window", None)
    if arch == GEMMA3:
        return sliding, tuple(hf.layer_types)
    if arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return sliding, ()
    if not sliding or not getattr(hf, "use_sliding_window", False):
        return None, ()
    types = tuple(getattr(hf, "layer_types", None) or ())
    if types and SLIDING not in types:
        return None, ()
    return sliding, (types if FULL in types else ())


def _check_computable(hf: Any, arch: str) -> None:
    """ValueError naming the config field when the decoder would compute something other than
    transformers does: it rotates every dimension of a head, and its MLP is SiLU-gated (GELU-tanh
    for Gemma 3, whose other fields `_check_gemma3` checks)."""
    for where, params in _rope_dicts(hf):
        for key, value in (
            ("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None)),
            (f"{where}['partial_rotary_factor']", params.get("partial_rotary_factor")),
        ):
            if value is not None and float(value) != 1.0:
                raise ValueError(
                    f"{arch}: {key} is {value}; only full rotary embeddings (1.0) are supported"
                )
    if arch == GEMMA3:
        _check_gemma3(hf, arch)
        return
    act = getattr(hf, "hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' two names of one function
        raise ValueError(f"{arch}: hidden_act is {act!r}; only 'silu' is supported")


def _rope_dicts(hf: Any) -> list[tuple[str, dict]]:
    """(how to name it, dict) for the config's rope parameters: the one dict, or one per layer
    type where transformers nests them so (Gemma 3)."""
    params = getattr(hf, "rope_parameters", None)
    if not isinstance(params, dict):
        return [("rope_parameters", {})]
    nested = [k for k in getattr(hf, "layer_types", None) or () if isinstance(params.get(k), dict)]
    if not nested:
        return [("rope_parameters", params)]
    return [(f"rope_parameters[{k!r}]", params[k]) for k in dict.fromkeys(nested)]


def _check_gemma3(hf: Any, arch: str) -> None:
    """Gemma 3's fields that change what transformers computes, each refused unless the
    decoder computes it (engine/models/gemma.py)."""
    act = getattr(hf, "hidden_activation", None)  # Gemma's field; its `hidden_act` is unread
    if act != "gelu_pytorch_tanh":
        raise ValueError(
            f"{arch}: hidden_activation is {act!r}; only 'gelu_pytorch_tanh' is supported"
        )
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if (cap := getattr(hf, name, None)) is not None:
            raise ValueError(f"{arch}: {name} is {cap}; soft-capping is not supported")
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError(f"{arch}: use_bidirectional_attention is set; only causal is supported")
    types = list(getattr(hf, "layer_types", None) or ())
    if len(types) != hf.num_hidden_layers or not set(types) <= {SLIDING, FULL}:
        raise ValueError(
            f"{arch}: layer_types is {types}; one of {SLIDING!r} or {FULL!r} per layer "
            f"({hf.num_hidden_layers}) is supported"
        )
    if SLIDING in types and not getattr(hf, "sliding_window", None):
        raise ValueError(f"{arch}: sliding_window is unset but layer_types has {SLIDING!r}")
    for where, params in _rope_dicts(hf):
        rope_type = params.get("rope_type", "default")
        if any(t in rope_type for t in ("dynamic", "longrope")):
            # Their frequencies change with the sequence length; Gemma's tables are built
            # per position (engine.models.rope), tested bit-equal for the other variants.
            raise ValueError(f"{arch}: {where}['rope_type'] is {rope_type!r}; it is not supported")


def _check_longrope_window(hf: Any, arch: str, window: int) -> None:
    """ValueError when a longrope model would serve past its original context. There the
    factors switch from short to long, and transformers computes every position of such a
    sequence with the long ones (Phi-3's `generate` recomputes the cache at the switch; a
    longer prompt is one forward), while the engine's rotary tables are per position
    (engine.models.rope), so a sequence's early keys would keep the short factors."""
    params = getattr(hf, "rope_parameters", None)
    if not isinstance(params, dict) or params.get("rope_type") != "longrope":
        return
    original = params.get("original_max_position_embeddings") or getattr(
        hf, "original_max_position_embeddings", None
    )
    if original and window > original:
        raise ValueError(
            f"{arch}: rope_type 'longrope' switches to its long factors past "
            f"original_max_position_embeddings ({original}) for every position of the "
            f"sequence, which per-position rotary tables cannot; serve a context window of at "
            f"most {original} tokens (max_model_len={original}), not {window}"
        )
