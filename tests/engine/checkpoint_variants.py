"""Helpers the architecture tests share (test_phi3, test_gemma3, test_moe,
test_qwen_sliding_window): a checkpoint copied with config.json keys changed, seeded random
prompts, greedy output checked token for token against transformers, logprobs checked
against its log-softmax, and a header-only GGUF file of an architecture."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from test_logprobs_and_choices import _check_entry, _hf_logprobs
from test_parity_hf import hf_greedy

from engine import LLM, SamplingParams


def variant(src: Path, dst: Path, weights: bool = True, **config) -> Path:
    """A copy of checkpoint `src` at `dst` with config.json's `config` keys set (None: null,
    which transformers reads as unset) and, unless not `weights`, its weights and tokenizer
    (without them: enough for ModelConfig)."""
    if weights:
        shutil.copytree(src, dst)
    else:
        dst.mkdir(parents=True)
        shutil.copy(src / "config.json", dst / "config.json")
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


def check_greedy(llm: LLM, path: Path, prompts, max_tokens: int = 12) -> None:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for p, out in zip(prompts, llm.generate(prompts, sp), strict=True):
        assert out.token_ids == hf_greedy(path, p, max_tokens), f"prompt of {len(p)} diverged"


def check_logprobs(llm: LLM, path, prompt: list[int], max_tokens: int) -> None:
    """A greedy answer's top-3 logprobs and the prompt's top-2 equal transformers' fp32
    log-softmax of the same tokens."""
    sp = SamplingParams(
        max_tokens=max_tokens, temperature=0, logprobs=3, prompt_logprobs=2, ignore_eos=True
    )
    out = llm.generate([prompt], sp)[0]
    ref = _hf_logprobs(path, prompt + out.token_ids)
    for p in range(1, len(prompt)):
        _check_entry(out.prompt_logprobs[p], ref[p - 1], prompt[p], 2)
    for j, token in enumerate(out.token_ids):
        _check_entry(out.logprobs[j], ref[len(prompt) - 1 + j], token, 3)


def header_only_gguf(path: Path, arch: str, expert_count: int | None = None) -> Path:
    """A GGUF file of `arch` with its metadata and no tensors: enough for ModelConfig to read
    (and refuse) the architecture before anything is mapped."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"{arch}-test")
    if expert_count is not None:
        writer.add_expert_count(expert_count)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
