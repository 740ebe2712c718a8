"""`tandem make-model`: write a seeded random-weight Hugging Face checkpoint.

Lifecycle: pick a `ModelShape` (arch x preset) -> train (or reuse) the byte-level BPE
tokenizer -> build the transformers config -> instantiate the model in float32 -> re-initialise
every parameter from a generator seeded by (seed, parameter name) -> `save_pretrained`
(config.json, model.safetensors, generation_config.json) -> save the tokenizer
(tokenizer.json, tokenizer_config.json with a chat template).

`cached_model(arch, preset, seed, cache_dir)` is the one cache of such checkpoints that the
demo, `tandem profile`, the benchmarks and the test fixtures share: made once per directory,
reused only when complete, safe when several processes ask at once.

The checkpoint is what `load_format="auto"` reads and what the correctness tests compare
against: Hugging Face transformers loads it with `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained`. Each architecture exercises a different corner of the Llama
family so a runtime that gets one of them wrong cannot pass on the others:

- llama:   GQA, llama3 rope scaling (original context 256, so it matters at 1024+ positions)
- mistral: MHA (kv heads == heads), no sliding window, 3 layers in `tiny`
- qwen2:   GQA, q/k/v biases, tied input/output embeddings
- qwen3:   MQA (1 kv head), head_dim != hidden/heads, per-head q/k RMSNorm
- phi3:    GQA, q/k/v and gate/up stored fused (`qkv_proj`, `gate_up_proj`), no sliding window
- gemma3:  sliding (20-token window, local rope base) and full layers (global base, linear
           scaling), (1 + w) norms around both sublayers, q/k norms, GELU-tanh, scaled tied
           embeddings, query_pre_attn_scalar (24) != head_dim (48) != hidden/heads (32)

and the sparse mixture-of-experts ones (`MOE_ARCHS`, kept out of `ARCHS`, which the
parametrized suites iterate):

- mixtral:   GQA, 8 SwiGLU experts in every layer, top 2 renormalised, per-expert w1/w2/w3
- qwen3_moe: GQA, q/k norms, head_dim 48, 8 experts of width 96 picked top 3 without
             renormalising, layer 1 a dense MLP (`mlp_only_layers`) of width 384

Weights are not HF's default init: the norms are 1 + 0.1*N(0,1) (so a runtime that ignores them
fails; Gemma's, which scale by 1 + w, have w = 0.3*N(0,1), 8 more in its post-sublayer norms,
so one that drops the 1 fails too), biases and q/k norms are non-zero, q/k projections are
scaled so attention scores have a standard deviation near 1 (attention is not uniform
averaging, so masking and RoPE mistakes show), and the output embedding gives logits with a
standard deviation near 2 (greedy decoding has clear winners). Same (arch, preset, seed) ->
byte-identical weights.

`--train-steps N` (`train_steps=N`) then trains the checkpoint for N steps on the embedded
corpus (`tools/train_model.py`). Random weights give near-flat next-token distributions, so
greedy agreement between two numerics (quantized vs exact) is decided by near-ties and
measures noise, and generated text is gibberish; a tiny model trained ~300 steps memorises
the corpus, its distributions are peaked like a trained model's and it prints readable text.
`cached_model` keys such checkpoints `-trained{N}`; random ones keep their names.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pathlib
import secrets
import shutil
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from tools.tiny_tokenizer import (  # noqa: F401 - CHAT_TEMPLATE, build_tokenizer: public here
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    build_tokenizer,
    save_tokenizer,
)

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3")
# Sparse mixture-of-experts architectures: apart from ARCHS, which the parametrized suites
# iterate (tests/engine/test_moe.py runs these).
MOE_ARCHS = ("mixtral", "qwen3_moe")
ALL_ARCHS = ARCHS + MOE_ARCHS
PRESETS = ("tiny", "small")

_CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "phi3": "Phi3Config",
    "gemma3": "Gemma3TextConfig",
    "mixtral": "MixtralConfig",
    "qwen3_moe": "Qwen3MoeConfig",
}
SLIDING, FULL = "sliding_attention", "full_attention"  # Gemma 3's two layer types


class MoEFields(NamedTuple):
    """A mixture-of-experts config's own fields: experts, experts per token, each expert's
    width (Mixtral's is `intermediate_size`), and Qwen3-MoE's routing normalisation and dense
    layers (`intermediate_size` wide)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False
    mlp_only_layers: tuple[int, ...] = ()


class GemmaFields(NamedTuple):
    """Gemma3TextConfig's own fields: each layer's type, the sliding layers' window and rope
    base, and the attention scale's denominator (scale = query_pre_attn_scalar ** -0.5)."""

    layer_types: tuple[str, ...]
    sliding_window: int
    rope_local_base_freq: float
    query_pre_attn_scalar: int


@dataclass(slots=True, frozen=True)
class ModelShape:
    """The numbers that define one (arch, preset) checkpoint."""

    arch: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool = False
    rope_scaling: dict[str, Any] | None = field(default=None)
    gemma: GemmaFields | None = None  # gemma3 only
    moe: MoEFields | None = None  # MOE_ARCHS only

    def __post_init__(self) -> None:
        if self.arch not in ALL_ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; choose one of {ALL_ARCHS}")
        if (self.arch in MOE_ARCHS) != (self.moe is not None):
            raise ValueError("the MoE archs (only) need MoEFields")
        if self.arch == "mixtral" and self.moe.moe_intermediate_size != self.intermediate_size:
            raise ValueError("mixtral: its experts are intermediate_size wide")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")
        if self.arch == "phi3" and self.head_dim * self.num_attention_heads != self.hidden_size:
            # Phi3Config has no head_dim field: its rope checks use hidden_size // heads.
            raise ValueError("phi3: head_dim must be hidden_size / num_attention_heads")
        types = self.gemma.layer_types if self.gemma else ()
        if (self.arch == "gemma3") != (len(types) == self.num_hidden_layers):
            raise ValueError("gemma3 (only) needs GemmaFields naming one type per layer")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError("vocab_size must hold the 256 byte tokens and the special tokens")
        if self.max_position_embeddings < 1:
            raise ValueError("max_position_embeddings must be positive")

    def num_parameters(self) -> int:
        """Parameter count without instantiating (tied embeddings counted once)."""
        h, q = self.hidden_size, self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.arch == "qwen2":
            attn += q + 2 * kv  # q/k/v biases
        if self.arch in ("qwen3", "gemma3", "qwen3_moe"):
            attn += 2 * self.head_dim  # q_norm, k_norm
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + (4 if self.gemma else 2) * h  # norms around the sublayers
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        total = self.num_hidden_layers * per_layer + embed + h  # + final norm
        if self.moe is not None:  # router and experts in place of the dense MLP
            e = self.moe.num_experts
            experts = e * h + e * 3 * h * self.moe.moe_intermediate_size
            total += self.num_moe_layers() * (experts - mlp)
        return total

    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - len(self.moe.mlp_only_layers) if self.moe else 0


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}

_GEMMA3_TINY = GemmaFields((SLIDING, SLIDING, FULL, SLIDING), 20, 10000.0, 24)
_GEMMA3_SMALL = GemmaFields((SLIDING,) * 5 + (FULL,) + (SLIDING,) * 2, 128, 10000.0, 64)  # 5:1
_LINEAR8 = {"rope_type": "linear", "factor": 8.0}  # Gemma 3 4B and up scale global rope so

# Mixtral: 8 experts, top 2, every layer sparse; Qwen3-MoE: 8 experts, top 3 unnormalised
# (Qwen3-30B-A3B renormalises: its norm_topk_prob), a dense middle layer, head_dim 48.
_MIXTRAL_TINY = MoEFields(8, 2, 256)
_QWEN3_MOE_TINY = MoEFields(8, 3, 96, False, (1,))
_MIXTRAL_SMALL = MoEFields(8, 2, 1024)
_QWEN3_MOE_SMALL = MoEFields(16, 4, 384, True, (0,))

_SHAPES: dict[tuple[str, str], ModelShape] = {
    ("llama", "tiny"): ModelShape(
        "llama", 128, 2, 4, 2, 32, 352, 1024, 1024, 500000.0, 1e-5, rope_scaling=_LLAMA3_ROPE
    ),
    ("mistral", "tiny"): ModelShape("mistral", 128, 3, 4, 4, 32, 384, 1024, 1024, 10000.0, 1e-5),
    ("qwen2", "tiny"): ModelShape(
        "qwen2", 128, 2, 4, 2, 32, 384, 1024, 1024, 1000000.0, 1e-6, tie_word_embeddings=True
    ),
    ("qwen3", "tiny"): ModelShape("qwen3", 128, 2, 4, 1, 48, 384, 1024, 1024, 1000000.0, 1e-6),
    ("phi3", "tiny"): ModelShape("phi3", 128, 2, 4, 2, 32, 320, 1024, 1024, 10000.0, 1e-5),
    ("gemma3", "tiny"): ModelShape(
        "gemma3", 128, 4, 4, 2, 48, 384, 1024, 1024, 1e6, 1e-6, True, _LINEAR8, _GEMMA3_TINY
    ),
    ("mixtral", "tiny"): ModelShape(
        "mixtral", 128, 2, 4, 2, 32, 256, 1024, 1024, 1e6, 1e-5, moe=_MIXTRAL_TINY
    ),
    ("qwen3_moe", "tiny"): ModelShape(
        "qwen3_moe", 128, 3, 4, 2, 48, 384, 1024, 1024, 1e6, 1e-6, moe=_QWEN3_MOE_TINY
    ),
    ("mixtral", "small"): ModelShape(
        "mixtral", 512, 4, 8, 2, 64, 1024, 8192, 2048, 1e6, 1e-5, moe=_MIXTRAL_SMALL
    ),
    ("qwen3_moe", "small"): ModelShape(
        "qwen3_moe", 512, 4, 8, 2, 64, 1536, 8192, 2048, 1e6, 1e-6, moe=_QWEN3_MOE_SMALL
    ),
    ("llama", "small"): ModelShape(
        "llama", 512, 8, 8, 4, 64, 1536, 8192, 2048, 500000.0, 1e-5, rope_scaling=_LLAMA3_ROPE
    ),
    ("mistral", "small"): ModelShape("mistral", 512, 8, 8, 8, 64, 1536, 8192, 2048, 10000.0, 1e-5),
    ("qwen2", "small"): ModelShape(
        "qwen2", 512, 8, 8, 2, 64, 2048, 8192, 2048, 1000000.0, 1e-6, tie_word_embeddings=True
    ),
    ("qwen3", "small"): ModelShape("qwen3", 512, 8, 8, 1, 96, 1536, 8192, 2048, 1000000.0, 1e-6),
    ("phi3", "small"): ModelShape("phi3", 512, 8, 8, 4, 64, 1536, 8192, 2048, 10000.0, 1e-5),
    ("gemma3", "small"): ModelShape(
        "gemma3", 512, 8, 8, 2, 96, 1536, 8192, 2048, 1e6, 1e-6, True, None, _GEMMA3_SMALL
    ),
}


def model_shape(arch: str, preset: str, max_position_embeddings: int | None = None) -> ModelShape:
    """The shape for (arch, preset), optionally with a different context length."""
    if (arch, preset) not in _SHAPES:
        raise ValueError(
            f"unknown arch/preset {arch!r}/{preset!r}; archs {ALL_ARCHS}, presets {PRESETS}"
        )
    shape = _SHAPES[(arch, preset)]
    if max_position_embeddings is not None:
        fields = asdict(shape)
        fields["max_position_embeddings"] = max_position_embeddings
        shape = ModelShape(**fields)
    return shape


def build_config(shape: ModelShape) -> Any:
    """The transformers config object for `shape` (float32, token ids of our tokenizer)."""
    import transformers

    cls = getattr(transformers, _CONFIG_CLASSES[shape.arch])
    kwargs: dict[str, Any] = {
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "initializer_range": 0.02,
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "attention_dropout": 0.0,
    }
    if shape.rope_scaling is not None:
        kwargs["rope_scaling"] = dict(shape.rope_scaling)
    if shape.gemma is not None:
        kwargs.update(shape.gemma._asdict(), layer_types=list(shape.gemma.layer_types))
        kwargs["hidden_activation"] = "gelu_pytorch_tanh"
    else:
        kwargs["hidden_act"] = "silu"
    if shape.arch in ("mistral", "phi3", "mixtral"):
        kwargs["sliding_window"] = None
    if shape.arch in ("qwen2", "qwen3"):
        kwargs["use_sliding_window"] = False
        kwargs["sliding_window"] = None
        kwargs["max_window_layers"] = shape.num_hidden_layers
    if shape.arch in ("qwen3", "qwen3_moe"):
        kwargs["attention_bias"] = False
    if shape.moe is not None:
        kwargs.update(_moe_kwargs(shape))
    return cls(**kwargs)


def _moe_kwargs(shape: ModelShape) -> dict[str, Any]:
    moe = shape.moe
    kwargs = {"num_experts_per_tok": moe.num_experts_per_tok, "router_aux_loss_coef": 0.0}
    if shape.arch == "mixtral":
        return {**kwargs, "num_local_experts": moe.num_experts, "router_jitter_noise": 0.0}
    return {
        **kwargs,
        "num_experts": moe.num_experts,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "norm_topk_prob": moe.norm_topk_prob,
        "mlp_only_layers": list(moe.mlp_only_layers),
        "decoder_sparse_step": 1,
        "use_sliding_window": False,
        "sliding_window": None,
    }


# ---------------------------------------------------------------------------- tokenizer


# ---------------------------------------------------------------------------- weights


def _generator(seed: int, name: str) -> Any:
    import torch

    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _init_std(name: str, shape: ModelShape) -> tuple[float, float]:
    """(mean, std) for the parameter called `name`; see the module docstring for why."""
    h = shape.hidden_size
    if name.endswith("norm.weight"):  # input/post-attention/final norms and q_norm/k_norm
        if shape.arch != "gemma3":
            return 1.0, 0.1
        # Gemma scales by 1 + w: w near 0; its post-sublayer norms ~9x (as trained ones), else the
        # scaled embedding of the last token rules the residual and the tied head repeats it.
        return (8.0, 0.3) if ".post_" in name else (0.0, 0.3)
    if name.endswith(".bias"):
        return 0.0, 0.2
    if "embed_tokens" in name or name.startswith("lm_head"):
        return 0.0, 2.0 / math.sqrt(h)  # logits std ~2 whether tied or not
    if "q_proj" in name or "k_proj" in name:
        return 0.0, 1.0 / math.sqrt(h)  # q, k ~unit scale: attention scores std ~1
    if "o_proj" in name or "down_proj" in name:
        # Residual branches scaled by depth so the residual stream stays bounded.
        fan_in = (
            shape.num_attention_heads * shape.head_dim
            if "o_proj" in name
            else shape.moe.moe_intermediate_size
            if ".experts." in name
            else shape.intermediate_size
        )
        return 0.0, 1.0 / math.sqrt(fan_in * 2 * shape.num_hidden_layers)
    if name.endswith("mlp.gate.weight"):  # a MoE router: logits std ~2, decisive choices
        return 0.0, 2.0 / math.sqrt(h)
    return 0.0, 1.0 / math.sqrt(h)  # v/gate/up: fan-in init


def _reinitialise(model: Any, shape: ModelShape, seed: int) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights appear once
            mean, std = _init_std(name, shape)
            values = torch.randn(param.shape, generator=_generator(seed, name), dtype=torch.float32)
            param.copy_(values * std + mean)


# ---------------------------------------------------------------------------- entry points


def make_model(
    out_dir: str | pathlib.Path,
    arch: str = "llama",
    preset: str = "tiny",
    seed: int = 0,
    max_position_embeddings: int | None = None,
    train_steps: int = 0,
) -> pathlib.Path:
    """Write a seeded random checkpoint for (arch, preset) into `out_dir`, then train it for
    `train_steps` steps on the embedded corpus when that is positive; return its path."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    _check_train_steps(train_steps)
    shape = model_shape(arch, preset, max_position_embeddings)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(shape.vocab_size, shape.max_position_embeddings)

    config = build_config(shape)
    torch.manual_seed(seed)  # HF's own init is overwritten, but keep it reproducible anyway
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    _reinitialise(model, shape, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    _patch_config_json(out / "config.json", shape)
    save_tokenizer(tokenizer, out)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"make-model: {arch}/{preset} seed={seed} params={n_params:,} "
        f"({n_params / 1e6:.2f}M) vocab={shape.vocab_size} -> {out}"
    )
    if train_steps > 0:
        _train(out, train_steps, seed)
    return out


def _check_train_steps(train_steps: int) -> None:
    if train_steps < 0:
        raise ValueError(f"train_steps must be 0 (random weights) or positive, got {train_steps}")


def _train(out: pathlib.Path, train_steps: int, seed: int) -> None:
    from tools.train_model import train_on_corpus

    record = train_on_corpus(out, train_steps, seed=seed)
    print(f"make-model: trained {train_steps} steps, loss {record['final_loss']:.3g} -> {out}")


COMPLETE_MARKER = ".tandem-complete"


def default_cache_dir() -> pathlib.Path:
    """`$XDG_CACHE_HOME/tandem/models` (else `~/.cache/tandem/models`): where the demo, `tandem
    profile` and benchmarks/compare_disagg.py keep their model, so a machine makes it once."""
    root = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(root) / "tandem" / "models"


def cached_model(
    arch: str = "llama",
    preset: str = "small",
    seed: int = 0,
    cache_dir: str | pathlib.Path | None = None,
    train_steps: int = 0,
) -> pathlib.Path:
    """The checkpoint for (arch, preset, seed) in `cache_dir` (default: `default_cache_dir()`),
    made on first use; returns `cache_dir/{arch}-{preset}-seed{seed}`, with `-trained{N}`
    appended when it is trained for `train_steps` = N > 0 steps (see `make_model`).

    A directory counts as made only when it holds `COMPLETE_MARKER`. It is written into a
    private temporary directory, the marker last, and renamed into place in one step, so a
    crash never leaves a directory that looks complete, and two processes making the same
    model at once both end up with the one that won the rename."""
    _check_train_steps(train_steps)
    root = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = f"{arch}-{preset}-seed{seed}" + (f"-trained{train_steps}" if train_steps > 0 else "")
    out = root / name
    if (out / COMPLETE_MARKER).is_file():
        return out
    model_shape(arch, preset)  # an unknown name fails here, before any directory is made
    root.mkdir(parents=True, exist_ok=True)
    tmp = _private_dir(out, "tmp")
    try:
        make_model(tmp, arch=arch, preset=preset, seed=seed)
        if train_steps > 0:  # not passed to make_model, whose stand-ins in tests lack it
            _train(tmp, train_steps, seed)
        (tmp / COMPLETE_MARKER).write_text(f"{arch} {preset} seed={seed} train={train_steps}\n")
        _discard_incomplete(out)
        try:
            tmp.rename(out)
        except OSError:
            # Another process renamed its copy into place first (a non-empty target).
            if not (out / COMPLETE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded
    return out


def _private_dir(out: pathlib.Path, kind: str) -> pathlib.Path:
    """A new directory beside `out` that no other process picks (pid and random suffix);
    made with mkdir, not mkdtemp, so the checkpoint keeps the umask's permissions."""
    path = out.parent / f".{out.name}.{kind}.{os.getpid()}.{secrets.token_hex(4)}"
    path.mkdir()
    return path


def _discard_incomplete(out: pathlib.Path) -> None:
    """Remove `out` if it exists without the marker (a crashed run, or an older cache layout)
    so the rename can take its place. It is first renamed to a unique name, an atomic step, so
    two processes never delete the same directory under each other."""
    if not out.exists() or (out / COMPLETE_MARKER).is_file():
        return
    trash = _private_dir(out, "trash")
    try:
        out.rename(trash / out.name)
    except FileNotFoundError:
        pass  # another process moved it first
    shutil.rmtree(trash, ignore_errors=True)


def _patch_config_json(path: pathlib.Path, shape: ModelShape) -> None:
    """Write the legacy (4.x) spellings beside whatever this transformers version wrote.

    transformers 5 stores rope settings under `rope_parameters` and the dtype under `dtype`;
    4.x reads `rope_theta`, `rope_scaling` and `torch_dtype`. Both read the other's keys too,
    but a runtime that reads config.json itself should find the classic ones.
    """
    cfg = json.loads(path.read_text())
    cfg["rope_theta"] = shape.rope_theta
    cfg["rope_scaling"] = dict(shape.rope_scaling) if shape.rope_scaling else None
    cfg["torch_dtype"] = "float32"
    cfg["head_dim"] = shape.head_dim
    if shape.gemma is not None:  # 4.x's name of the sliding layers' rope base
        cfg["rope_local_base_freq"] = shape.gemma.rope_local_base_freq
    if shape.arch == "qwen3_moe":  # Qwen's own name (5.x writes its alias num_local_experts)
        cfg["num_experts"] = shape.moe.num_experts
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", type=pathlib.Path, help="directory to write the checkpoint")
    parser.add_argument("--arch", choices=ALL_ARCHS, default="llama")
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-position-embeddings", type=int, default=None, help="override the context length"
    )
    parser.add_argument(
        "--train-steps",
        type=int,
        default=0,
        help="train this many steps on the embedded corpus (peaked distributions; 0: random)",
    )


def run(args: argparse.Namespace) -> int:
    make_model(
        args.out_dir,
        arch=args.arch,
        preset=args.preset,
        seed=args.seed,
        max_position_embeddings=args.max_position_embeddings,
        train_steps=args.train_steps,
    )
    return 0
