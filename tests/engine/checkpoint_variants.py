"""Helpers the architecture tests share (test_phi3, test_gemma3, test_qwen_sliding_window): a
checkpoint copied with config.json keys changed, seeded random prompts, and greedy output
checked token for token against transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
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
