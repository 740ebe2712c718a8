"""Phi-3 (`Phi3ForCausalLM`) beyond the suites every architecture runs (test_parity_hf,
test_logprobs_and_choices, test_tensor_parallel, test_rope): its checkpoint stores q/k/v and
gate/up fused, and the loader reads that layout as strictly as the split one; a sliding window
shorter than the prompt and longrope scaling stay token-exact with transformers (fp32); what
the decoder cannot compute (partial rotary, another activation, a phi3 GGUF file) is refused
with the setting named."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_variants import check_greedy as _check_greedy
from checkpoint_variants import header_only_gguf
from checkpoint_variants import random_prompts as _prompts
from checkpoint_variants import variant as _variant
from safetensors.torch import load_file, save_file
from test_parity_hf import hf_greedy

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.gguf_file import GGUFError
from engine.loader import build_model
from engine.models.parallel import Shard, ShardedCheckpoint

WINDOW = 24
# Phi-3.5-mini's longrope, small: per-frequency factors for head_dim 32, original context 64.
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 1.0,
    "short_factor": [1.0 + 0.05 * i for i in range(16)],
    "long_factor": [1.5 + 0.5 * i for i in range(16)],
    "original_max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def windowed(make_tiny_model, tmp_path_factory) -> Path:
    """The tiny phi3 with a 24-token sliding window."""
    root = tmp_path_factory.mktemp("phi3-window")
    return _variant(make_tiny_model("phi3"), root / "model", sliding_window=WINDOW)


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_sliding_window_shorter_than_the_prompt_matches_hf(windowed, chunked):
    llm = LLM(
        windowed,
        dtype="float32",
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=32 if chunked else 128,
        enable_prefix_caching=False,
    )
    assert llm.engine.model_config.sliding_window == WINDOW
    _check_greedy(llm, windowed, _prompts([60, 5, 23, 25, 100]), 20)


def test_sliding_window_with_prefix_cache_hits_matches_hf(windowed):
    llm = LLM(windowed, dtype="float32", max_num_batched_tokens=64)
    shared = _prompts([48], seed=1)[0]
    prompts = [shared + tail for tail in _prompts([12, 1, 30], seed=2)]
    _check_greedy(llm, windowed, prompts[:1], 10)
    _check_greedy(llm, windowed, prompts, 16)


def test_the_window_changes_transformers_output(make_tiny_model, windowed):
    """The window test is not vacuous: transformers' logits past the window differ."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor(_prompts([60]))
    logits = []
    for path in (make_tiny_model("phi3"), windowed):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(ids).logits[0])
    assert torch.equal(logits[0][:WINDOW], logits[1][:WINDOW])
    assert (logits[0][-1] - logits[1][-1]).abs().max() > 1e-3


@pytest.mark.parametrize("window", [None, 2047])
def test_sliding_window_is_the_configs(make_tiny_model, tmp_path, window):
    """As transformers' Phi3: the config's value applies as it is (Phi-3-mini-4k: 2047)."""
    path = _variant(make_tiny_model("phi3"), tmp_path / "m", weights=False, sliding_window=window)
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.sliding_window == window
    assert cfg.architecture == "Phi3ForCausalLM" and cfg.prefused_checkpoint
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.qk_norm or cfg.tie_word_embeddings)


@pytest.fixture(scope="module")
def longrope(make_tiny_model, tmp_path_factory) -> Path:
    """The tiny phi3 with longrope scaling from an original context of 64 tokens (of 1024)."""
    return _variant(
        make_tiny_model("phi3"),
        tmp_path_factory.mktemp("phi3-longrope") / "model",
        rope_parameters=LONGROPE,
        rope_scaling=LONGROPE,
        original_max_position_embeddings=64,
    )


def test_longrope_inside_the_original_context_matches_hf(longrope):
    """Served inside the original context (max_model_len 64), every position has the short
    factors, as transformers computes a sequence that fits it."""
    llm = LLM(longrope, dtype="float32", max_model_len=64, max_num_batched_tokens=32)
    rope = llm.engine.model_config.hf_config.rope_parameters
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 64
    prompts = _prompts([10, 40, 63], seed=4)
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for p, out in zip(prompts, llm.generate(prompts, sp), strict=True):
        n = min(30, 64 - len(p))  # the window ends the sequence at 64 tokens
        assert out.token_ids == hf_greedy(longrope, p, n), f"prompt of {len(p)} diverged"


def test_longrope_past_the_original_context_is_refused(longrope):
    """Past it transformers recomputes the whole sequence with the long factors (Phi-3's
    `generate` drops its cache at the switch), which per-position rotary tables cannot."""
    with pytest.raises(ValueError, match=r"original_max_position_embeddings \(64\)"):
        LLM(longrope, dtype="float32", num_kv_blocks=8)
    with pytest.raises(ValueError, match="max_model_len=64"):
        LLM(longrope, dtype="float32", num_kv_blocks=8, max_model_len=65)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("partial_rotary_factor", 0.75, "partial_rotary_factor"),
        ("hidden_act", "gelu_new", "hidden_act"),
    ],
)
def test_what_the_decoder_cannot_compute_is_refused(make_tiny_model, tmp_path, field, value, named):
    path = _variant(make_tiny_model("phi3"), tmp_path / "m", weights=False, **{field: value})
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_pretrained(path)


def test_a_phi3_gguf_file_is_refused(tmp_path):
    path = header_only_gguf(tmp_path / "phi3.gguf", "phi3")
    with pytest.raises(GGUFError, match="'general.architecture' is 'phi3'"):
        ModelConfig.from_pretrained(path)


# ------------------------------------------------------------------ checkpoint layouts


def _rewrite_weights(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint `src` whose tensors `edit(dict)` changed in place."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _load_error(path: Path) -> str:
    cfg = ModelConfig.from_pretrained(path)
    with pytest.raises(ValueError) as err:
        build_model(cfg, torch.float32, torch.device("cpu"), "auto", 0)
    return str(err.value)


def _split_qkv(tensors: dict, cfg: ModelConfig) -> None:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name in [n for n in tensors if ".qkv_proj." in n]:
        parts = tensors.pop(name).split([q, kv, kv])
        for part, t in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
            tensors[name.replace(".qkv_proj.", f".{part}.")] = t.contiguous()


def _fuse_qkv(tensors: dict) -> None:
    for name in [n for n in tensors if ".q_proj." in n]:
        parts = [tensors.pop(name.replace(".q_proj.", f".{p}_proj.")) for p in "qkv"]
        tensors[name.replace(".q_proj.", ".qkv_proj.")] = torch.cat(parts)


def test_a_prefused_checkpoint_lacking_a_tensor_is_named(make_tiny_model, tmp_path):
    def drop(t):
        del t["model.layers.1.mlp.gate_up_proj.weight"]

    path = _rewrite_weights(make_tiny_model("phi3"), tmp_path / "m", drop)
    msg = _load_error(path)
    assert "lacks weights" in msg and "model.layers.1.mlp.gate_up_proj.weight" in msg, msg


def test_a_phi3_checkpoint_in_the_split_layout_is_refused(make_tiny_model, tmp_path):
    """Each architecture has one layout: split q/k/v names in a Phi-3 checkpoint are unknown."""
    src = make_tiny_model("phi3")
    cfg = ModelConfig.from_pretrained(src)
    path = _rewrite_weights(src, tmp_path / "m", lambda t: _split_qkv(t, cfg))
    msg = _load_error(path)
    assert "unexpected weight" in msg and "_proj.weight" in msg, msg


def test_a_llama_checkpoint_with_fused_qkv_is_refused(make_tiny_model, tmp_path):
    path = _rewrite_weights(make_tiny_model("llama"), tmp_path / "m", _fuse_qkv)
    msg = _load_error(path)
    assert "unexpected weight" in msg and "qkv_proj" in msg, msg


class _Tensors:
    """A checkpoint reader (engine/loader.py's interface) over a dict of tensors."""

    def __init__(self, tensors: dict):
        self.tensors, self.path = tensors, "memory"
        self.where = {n: "memory" for n in tensors}

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]


@pytest.mark.parametrize("tp", [2, 4])
def test_a_fused_tensor_is_cut_as_its_parts_are(make_tiny_model, tp):
    """Every rank's slice of a pre-fused qkv_proj / gate_up_proj is its q, k, v (gate, up)
    slices, cut as the split checkpoint's tensors are, concatenated; at TP 4 each rank keeps
    a copy of its one KV head (2 KV heads)."""
    cfg = ModelConfig.from_pretrained(make_tiny_model("phi3"))
    tensors = load_file(make_tiny_model("phi3") / "model.safetensors")
    split = dict(tensors)
    _split_qkv(split, cfg)
    layer = "model.layers.0"
    gate, up = split.pop(f"{layer}.mlp.gate_up_proj.weight").chunk(2)
    split[f"{layer}.mlp.gate_proj.weight"], split[f"{layer}.mlp.up_proj.weight"] = gate, up
    for rank in range(tp):
        shard = Shard.of(cfg, rank, tp)
        fused, parts = (
            ShardedCheckpoint(_Tensors(tensors), shard),
            ShardedCheckpoint(_Tensors(split), shard),
        )
        qkv = [parts.get(f"{layer}.self_attn.{p}_proj.weight") for p in "qkv"]
        assert torch.equal(fused.get(f"{layer}.self_attn.qkv_proj.weight"), torch.cat(qkv))
        mlp = [parts.get(f"{layer}.mlp.{p}_proj.weight") for p in ("gate", "up")]
        assert torch.equal(fused.get(f"{layer}.mlp.gate_up_proj.weight"), torch.cat(mlp))
        local = shard.local_config()
        assert qkv[0].shape[0] == local.num_heads * cfg.head_dim
        assert qkv[1].shape[0] == local.num_kv_heads * cfg.head_dim
