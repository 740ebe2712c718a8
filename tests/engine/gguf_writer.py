"""Write a Hugging Face checkpoint as one GGUF file, the way llama.cpp's `convert_hf_to_gguf.py` does.

A test helper, not a converter for arbitrary models: it covers the dense Llama-family checkpoints
`tools/make_model.py` builds (llama, mistral, qwen2, qwen3) and uses nothing but the `gguf`
package's `GGUFWriter` (and `gguf.quantize` for the quantized types), so a GGUF reader can be
tested without llama.cpp on the machine.

What it reproduces from llama.cpp, because a reader of real files depends on each:

- mistral is written as GGUF arch "llama" (llama.cpp has no mistral arch);
- q_proj/k_proj of the llama arch are permuted from HF's rotate-half layout to llama.cpp's
  interleaved-pairs layout; qwen2/qwen3 are written as they are;
- llama3 rope scaling is a `rope_freqs.weight` tensor of per-frequency divisors, not metadata;
- 1-D tensors (norms, biases, rope_freqs) stay F32 whatever `tensor_type` asks for;
- a tied lm_head is not written (a reader ties `output` to `token_embd` when it is absent);
- the tokenizer is metadata: a "gpt2" (byte-level BPE) vocabulary with token types and merges.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# HF model_type -> GGUF architecture.
_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# tensor_type -> (type of the 2-D weights, general.file_type).
_TENSOR_TYPES = {
    "F32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "F16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "BF16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "Q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}

# Pre-tokenizer split regexes llama.cpp knows by name (tokenizer.ggml.pre). llama.cpp picks the
# name by hashing a tokenization of a fixed text, which only works for vocabularies it has seen;
# matching the regex itself gives the same answer for any vocabulary split the same way.
_PRE_TOKENIZERS = {
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ): "qwen2",
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ): "llama-bpe",
}


def write_gguf(hf_dir: Path, out_path: Path, tensor_type: str = "F32") -> Path:
    """Convert the checkpoint in `hf_dir` to the GGUF file `out_path`; returns `out_path`.

    `tensor_type` ("F32", "F16", "BF16" or "Q8_0") is the type of the 2-D weight matrices.
    """
    if tensor_type not in _TENSOR_TYPES:
        raise ValueError(f"tensor_type must be one of {sorted(_TENSOR_TYPES)}, got {tensor_type!r}")
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    config = json.loads((hf_dir / "config.json").read_text())
    model_type = config["model_type"]
    if model_type not in _GGUF_ARCH:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(_GGUF_ARCH)}")
    arch = _GGUF_ARCH[model_type]
    qtype, file_type = _TENSOR_TYPES[tensor_type]

    writer = gguf.GGUFWriter(out_path, arch)
    try:
        writer.add_name(_model_name(hf_dir, model_type))
        _add_hparams(writer, config, arch)
        writer.add_file_type(file_type)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)  # llama.cpp writes it always
        _add_tokenizer(writer, hf_dir, config)
        _add_tensors(writer, hf_dir, config, arch, qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return out_path


# ---------------------------------------------------------------------------- hyperparameters


def _model_name(hf_dir: Path, model_type: str) -> str:
    """general.name: the directory's name, with "mistral" in it for mistral, since a llama-arch
    file says it is mistral only through its name.

    Not the bare name "mistral": transformers 5 reads a file as mistral only when the name is
    exactly that, and then fails to map its tensors (gguf-py has no "mistral" arch). A name that
    contains it loads as LlamaForCausalLM, the same computation without a sliding window."""
    name = hf_dir.name
    if model_type == "mistral" and "mistral" not in name.lower():
        name = f"mistral-{name}"
    return name


def _rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """Rope settings from either layout: transformers 5's `rope_parameters` (theta inside) or
    4.x's top-level `rope_theta` plus `rope_scaling`."""
    params = dict(config.get("rope_scaling") or {})
    params.update(config.get("rope_parameters") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return params


def _head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _add_hparams(writer: gguf.GGUFWriter, config: dict[str, Any], arch: str) -> None:
    rope = _rope_parameters(config)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads", config["num_attention_heads"]))
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    head_dim = _head_dim(config)
    if head_dim != config["hidden_size"] // config["num_attention_heads"]:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        # llama.cpp's LlamaModel adds these two; readers size the vocab and rope from them.
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
    if rope.get("rope_type", rope.get("type")) == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))


def _llama3_rope_factors(config: dict[str, Any]) -> np.ndarray | None:
    """The divisor of each rope frequency under llama3 scaling (llama.cpp's rope_freqs tensor),
    or None when the checkpoint has no llama3 scaling."""
    rope = _rope_parameters(config)
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return None
    dim = _head_dim(config)
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    # llama.cpp reads the original context from the top level of config.json; transformers
    # keeps it inside the rope settings, which is where this checkpoint has it.
    old_ctx = rope.get("original_max_position_embeddings") or config.get(
        "original_max_position_embeddings", 8192
    )
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            factors.append(1.0)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


# ---------------------------------------------------------------------------- tokenizer


def _add_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, config: dict[str, Any]) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tok_cfg_path = hf_dir / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text(encoding="utf-8")) if tok_cfg_path.exists() else {}
    model = tok["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"only BPE tokenizers are supported, got {model.get('type')!r}")

    tokens, types = _vocab(tok, config.get("vocab_size"))
    ids = {token: i for i, token in enumerate(tokens)}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer_name(tok))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # tokenizers writes merges as "a b" strings (older files) or [a, b] pairs (newer ones).
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])

    for key, add in (
        ("bos", writer.add_bos_token_id),
        ("eos", writer.add_eos_token_id),
        ("pad", writer.add_pad_token_id),
        ("unk", writer.add_unk_token_id),
    ):
        token_id = _special_id(key, tok_cfg, config, ids)
        if token_id is not None:
            add(token_id)
    writer.add_add_bos_token(_adds_bos(tok, tok_cfg))
    if "add_eos_token" in tok_cfg:
        writer.add_add_eos_token(bool(tok_cfg["add_eos_token"]))
    if (template := _chat_template(hf_dir, tok_cfg)) is not None:
        writer.add_chat_template(template)


def _vocab(tok: dict[str, Any], vocab_size: int | None) -> tuple[list[str], list[int]]:
    """Tokens by id and their llama.cpp types, padded to the model's vocab size as llama.cpp
    pads them ("[PAD{id}]", UNUSED) so the embedding rows and the token list agree."""
    by_id: dict[int, tuple[str, int]] = {
        i: (t, gguf.TokenType.NORMAL) for t, i in tok["model"]["vocab"].items()
    }
    for added in tok.get("added_tokens", []):
        kind = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        by_id[added["id"]] = (added["content"], kind)
    size = max(vocab_size or 0, max(by_id) + 1)
    tokens, types = [], []
    for i in range(size):
        token, kind = by_id.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED))
        tokens.append(token)
        types.append(int(kind))
    return tokens, types


def _pre_tokenizer_name(tok: dict[str, Any]) -> str:
    """llama.cpp's name for the tokenizer's split regex ("default" when it is none we know)."""
    stack = [tok.get("pre_tokenizer") or {}]
    while stack:
        node = stack.pop()
        if node.get("type") == "Split":
            return _PRE_TOKENIZERS.get(node.get("pattern", {}).get("Regex"), "default")
        stack.extend(node.get("pretokenizers") or [])
    return "default"


def _special_id(
    key: str, tok_cfg: dict[str, Any], config: dict[str, Any], ids: dict[str, int]
) -> int | None:
    """The id of the bos/eos/pad/unk token: tokenizer_config.json names it (a string or an
    AddedToken dict), else config.json gives the id, as llama.cpp's SpecialVocab looks."""
    token = tok_cfg.get(f"{key}_token")
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str) and token in ids:
        return ids[token]
    token_id = config.get(f"{key}_token_id")
    if isinstance(token_id, list):  # several eos ids: GGUF holds one
        token_id = token_id[0] if token_id else None
    return token_id


def _adds_bos(tok: dict[str, Any], tok_cfg: dict[str, Any]) -> bool:
    """Whether encoding prepends bos: tokenizer_config.json's flag when it has one, else what
    tokenizer.json's post-processor does (a template that starts with the bos token)."""
    if "add_bos_token" in tok_cfg:
        return bool(tok_cfg["add_bos_token"])
    post = tok.get("post_processor") or {}
    nodes = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    bos = tok_cfg.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    for node in nodes:
        if node.get("type") == "TemplateProcessing" and node.get("single"):
            first = node["single"][0]
            return "SpecialToken" in first and first["SpecialToken"]["id"] == bos
    return False


def _chat_template(hf_dir: Path, tok_cfg: dict[str, Any]) -> str | list[dict[str, str]] | None:
    """chat_template.jinja (where transformers 5 saves it) first, else tokenizer_config.json's."""
    jinja = hf_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    return tok_cfg.get("chat_template")


# ---------------------------------------------------------------------------- tensors


def _load_state_dict(hf_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint as float32 numpy (single file or sharded)."""
    from safetensors.torch import load_file

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {hf_dir}")
    out: dict[str, np.ndarray] = {}
    for path in files:
        # Through torch: numpy has no bfloat16, and a bf16 checkpoint must load too.
        out.update({k: v.float().numpy() for k, v in load_file(path).items()})
    return out


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half q/k rows -> llama.cpp's interleaved pairs (convert_hf_to_gguf.py)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _encode(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> tuple[np.ndarray, Any]:
    """`data` in `qtype` and the raw_dtype to hand GGUFWriter (None for plain numpy dtypes)."""
    if qtype == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(data, dtype=np.float32), None
    if qtype == gguf.GGMLQuantizationType.F16:
        return np.ascontiguousarray(data, dtype=np.float16), None
    try:
        return gguf.quantize(data, qtype), qtype
    except gguf.QuantError:
        # llama.cpp's fallback when a row is not a whole number of blocks.
        return np.ascontiguousarray(data, dtype=np.float16), None


def _add_tensors(
    writer: gguf.GGUFWriter,
    hf_dir: Path,
    config: dict[str, Any],
    arch: str,
    qtype: gguf.GGMLQuantizationType,
) -> None:
    n_layers = config["num_hidden_layers"]
    n_head = config["num_attention_heads"]
    n_kv_head = config.get("num_key_value_heads", n_head)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers)
    if (factors := _llama3_rope_factors(config)) is not None:
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors)
    for hf_name, data in _load_state_dict(hf_dir).items():
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue  # the reader ties output to token_embd when output is absent
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from rope settings; llama.cpp drops it too
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for tensor {hf_name!r} of arch {arch!r}")
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            data = _permute(data, n_head)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            data = _permute(data, n_kv_head)
        # llama.cpp keeps 1-D tensors (norms, biases) in F32 whatever the file type.
        encoded, raw_dtype = _encode(
            data, qtype if data.ndim >= 2 else gguf.GGMLQuantizationType.F32
        )
        writer.add_tensor(name, encoded, raw_dtype=raw_dtype)
