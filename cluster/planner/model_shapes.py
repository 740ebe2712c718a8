"""Transformer shapes for the roofline (cluster/planner/roofline.py): `ModelShape`, read from a
Hugging Face config.json (`shape_from_config`) or taken from `PRESETS`, the published configs
of well-known models (the numbers are the `config.json` fields of each model's Hugging Face
repository: meta-llama/Meta-Llama-3-8B, Meta-Llama-3-70B, Llama-3.1-8B, Llama-3.2-1B/3B,
Qwen/Qwen2.5-7B/14B/32B/72B-Instruct, Qwen/Qwen3-8B, mistralai/Mistral-7B-v0.3; the
mixture-of-experts mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen3-30B-A3B).

Parameter counts follow the Llama family's layout (tandem's engine runs that family): per
layer q/k/v/o projections (+ q/k/v biases for Qwen2), a gated MLP (3 matrices) and two norms;
an embedding table and an LM head (one tensor when tied).

Mixture-of-experts shapes (the engine's MixtralForCausalLM and Qwen3MoeForCausalLM,
engine/models/moe.py) replace the MLP of each sparse layer by `num_experts` gated experts of
`expert_intermediate_size` and a router (hidden x experts, no bias) that sends each token to
`experts_per_token` of them; `dense_layers` keep the dense MLP (Qwen3-MoE's `mlp_only_layers`
and the layers off every `decoder_sparse_step`-th; Mixtral: none). `num_params` counts every
expert, `active_params` what one token runs (the top-k experts and the router). Families the
engine refuses (a shared expert: Qwen2-MoE, DeepSeek; OLMoE; any other) are refused here by
name, so the planner never plans for a model tandem cannot serve.
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
    intermediate_size: int  # the dense MLP's (a MoE model's dense layers; Mixtral: the experts')
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position: int = 8192
    # Mixture of experts (0: a dense model): routed experts, experts each token runs, each
    # expert's MLP width, and the layers that keep the dense MLP instead (0-based).
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()

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
        self._check_experts()

    def _check_experts(self) -> None:
        if not self.is_moe:
            if self.num_experts or self.experts_per_token or self.expert_intermediate_size:
                raise ValueError(f"model {self.name}: expert fields need num_experts >= 1")
            if self.dense_layers:
                raise ValueError(f"model {self.name}: dense_layers is for a MoE model")
            return
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"model {self.name}: experts_per_token must be in 1..{self.num_experts}"
            )
        if self.expert_intermediate_size < 1:
            raise ValueError(f"model {self.name}: expert_intermediate_size must be >= 1")
        layers = self.dense_layers
        if list(layers) != sorted(set(layers)) or not all(0 <= i < self.num_layers for i in layers):
            raise ValueError(
                f"model {self.name}: dense_layers must be distinct ascending layer indices "
                f"below {self.num_layers}"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_sparse_layers(self) -> int:
        """Layers whose MLP is the experts (0 for a dense model)."""
        return self.num_layers - len(self.dense_layers) if self.is_moe else 0

    @property
    def attention_params(self) -> int:
        """One layer's attention projections (and biases) and its two norms."""
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        return h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0) + 2 * h

    @property
    def layer_params(self) -> int:
        """One layer with the dense MLP (every layer of a dense model)."""
        return self.attention_params + 3 * self.hidden_size * self.intermediate_size

    @property
    def expert_params(self) -> int:
        """One expert's gated MLP (gate, up, down) in one sparse layer."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    @property
    def router_params(self) -> int:
        """A sparse layer's router: one logit per expert from the hidden state, no bias."""
        return self.hidden_size * self.num_experts

    def _stack_params(self, experts: int) -> int:
        dense = self.num_layers - self.num_sparse_layers
        sparse = self.attention_params + experts * self.expert_params + self.router_params
        return dense * self.layer_params + self.num_sparse_layers * sparse

    @property
    def stack_params(self) -> int:
        """The decoder layers' parameters, every expert included (a dense model's: layers x
        layer_params)."""
        return self._stack_params(self.num_experts)

    @property
    def active_stack_params(self) -> int:
        """The decoder layers' parameters one token runs: the attention, the dense layers'
        MLP, and in each sparse layer the router and the top-k experts."""
        return self._stack_params(self.experts_per_token)

    @property
    def expert_stack_params(self) -> int:
        """Every expert of every sparse layer (what a MoE step reads beyond a dense one's)."""
        return self.num_sparse_layers * self.num_experts * self.expert_params

    @property
    def router_stack_params(self) -> int:
        return self.num_sparse_layers * self.router_params

    @property
    def table_params(self) -> int:
        """One vocab x hidden table (the embedding, or the LM head)."""
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        tables = self.table_params * (1 if self.tie_word_embeddings else 2)
        return self.stack_params + tables + self.hidden_size

    @property
    def active_params(self) -> int:
        """The parameters one token runs (MoE: its top-k experts; a dense model: all)."""
        return self.num_params - self.stack_params + self.active_stack_params

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
        every projection a token runs (MoE: its top-k experts and the router) once per token,
        the LM head once per prompt (logits of the last token only), and causal attention (QK^T
        and PV over half the square of each prompt)."""
        per_prompt = tokens / prompts
        attn = self.attention_flops_per_token2() * per_prompt**2 * prompts
        return 2 * self.active_stack_params * tokens + 2 * self.table_params * prompts + attn

    def attention_flops_per_token2(self) -> float:
        """Causal attention FLOPs of one prompt per squared token (QK^T and PV, 2 FLOPs per
        multiply-add, over half the square)."""
        return 2 * self.num_layers * self.num_heads * self.head_dim

    def decode_flops_per_seq(self) -> float:
        """FLOPs one sequence adds to a decode step: every projection it runs (MoE: its top-k
        experts and the router) and the LM head."""
        return 2.0 * (self.active_stack_params + self.table_params)


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
# Mixture of experts, the same fields and then num_local_experts / num_experts,
# num_experts_per_tok, the experts' width (Mixtral: intermediate_size; Qwen3-MoE:
# moe_intermediate_size) and the dense layers (Qwen3-30B-A3B: mlp_only_layers [], step 1).
_PUBLISHED_MOE = (
    ("mixtral-8x7b", 32, 4096, 14336, 32, 8, 128, 32000, False, False, 32768, 8, 2, 14336),
    ("qwen3-30b-a3b", 48, 2048, 6144, 32, 4, 128, 151936, False, False, 40960, 128, 8, 768),
)
PRESETS.update({row[0]: ModelShape(*row) for row in _PUBLISHED_MOE})

# The mixture-of-experts architectures the engine serves (engine/config.py MOE_ARCHITECTURES),
# keyed by the config's `architectures` entry or, without one, its `model_type`.
MIXTRAL, QWEN3_MOE = "MixtralForCausalLM", "Qwen3MoeForCausalLM"
_MOE_MODEL_TYPES = {"mixtral": MIXTRAL, "qwen3_moe": QWEN3_MOE}
# Those it refuses, with its reason (engine/config.py UNSERVED_MOE; kept here so `tandem plan`
# does not import torch, and checked against the engine's by tests/capacity/test_roofline_moe).
UNSERVED_MOE = {
    "OlmoeForCausalLM": "its q/k norms span all heads at once and it clips q/k/v (clip_qkv)",
    "Qwen2MoeForCausalLM": "its shared expert and that expert's sigmoid gate are not computed",
}
_UNSERVED_MODEL_TYPES = {"olmoe": "OlmoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
# Fields that mark a mixture-of-experts config, and those of a shared (always-run) expert,
# which tandem's MoE block does not compute (Qwen2-MoE, DeepSeek-V2/V3).
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
_SHARED_EXPERT_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts")


def _architecture(cfg: dict) -> str:
    archs = cfg.get("architectures") or ()
    if archs:
        return str(archs[0])
    model_type = str(cfg.get("model_type", ""))
    return _MOE_MODEL_TYPES.get(model_type) or _UNSERVED_MODEL_TYPES.get(model_type) or model_type


def _refuse_unserved_moe(cfg: dict, path: Path) -> str | None:
    """The served MoE architecture of `cfg` (None: a dense config); ValueError naming a
    mixture-of-experts family the engine refuses, and why."""
    arch = _architecture(cfg)
    if arch in UNSERVED_MOE:
        raise ValueError(
            f"{path}: mixture-of-experts architecture {arch} is not served by tandem: "
            f"{UNSERVED_MOE[arch]}"
        )
    shared = [k for k in _SHARED_EXPERT_FIELDS if cfg.get(k)]
    if shared:
        raise ValueError(
            f"{path}: mixture-of-experts architecture {arch or 'unknown'} has a shared expert "
            f"({shared[0]}), which tandem's MoE block does not compute"
        )
    if arch in (MIXTRAL, QWEN3_MOE):
        return arch
    moe = [k for k in _MOE_FIELDS if cfg.get(k)]
    if moe:
        raise ValueError(
            f"{path}: mixture-of-experts architecture {arch or 'unknown'} ({moe[0]}) is not "
            f"served by tandem, whose engine runs the experts of {MIXTRAL} and {QWEN3_MOE} only"
        )
    return None


def _int_field(cfg: dict, path: Path, *names: str) -> int:
    """The first of `names` the config sets, as an int (a name names the field it lacks)."""
    for name in names:
        if cfg.get(name) is not None:
            return int(cfg[name])
    raise ValueError(f"{path}: config.json lacks {names[0]}")


def _experts(cfg: dict, path: Path, arch: str, layers: int) -> dict:
    """ModelShape's expert fields of a served MoE config, as transformers (and the engine's
    `_moe_config`) read them: Qwen3-MoE's layer i is sparse unless listed in
    `mlp_only_layers` and when (i + 1) is a multiple of `decoder_sparse_step`."""
    # transformers 5 writes the expert count under its alias num_local_experts for both.
    n = _int_field(cfg, path, "num_local_experts", "num_experts")
    if n < 1:  # Qwen3-MoE without experts: every layer dense
        return {}
    k = _int_field(cfg, path, "num_experts_per_tok")
    if arch == MIXTRAL:
        width, dense = _int_field(cfg, path, "intermediate_size"), ()
    else:
        width = _int_field(cfg, path, "moe_intermediate_size")
        step = cfg.get("decoder_sparse_step", 1)
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"{path}: decoder_sparse_step is {step!r}; a layer interval >= 1")
        only = {int(i) for i in cfg.get("mlp_only_layers") or ()}
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    if len(dense) == layers:  # no layer runs the experts: the dense shape
        return {}
    return dict(
        num_experts=n, experts_per_token=k, expert_intermediate_size=width, dense_layers=dense
    )


def shape_from_config(path: str | Path, name: str | None = None) -> ModelShape:
    """The shape in a Hugging Face config.json (or a model directory holding one); a
    multimodal config's `text_config` is read. ValueError naming what is missing or wrong, or
    the mixture-of-experts family tandem does not serve."""
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
    moe_arch = _refuse_unserved_moe(cfg, path)
    need = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
    missing = [k for k in (*need, "vocab_size") if k not in cfg]
    if missing:
        raise ValueError(f"{path}: config.json lacks {', '.join(missing)}")
    heads, layers = int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
    experts = _experts(cfg, path, moe_arch, layers) if moe_arch else {}
    return ModelShape(
        name=name or path.parent.name or "model",
        num_layers=layers,
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        vocab_size=int(cfg["vocab_size"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
        max_position=int(cfg.get("max_position_embeddings") or 8192),
        **experts,
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
