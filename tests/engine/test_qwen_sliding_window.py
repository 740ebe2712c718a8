"""Qwen2/Qwen3's sliding window as transformers applies it: only with `use_sliding_window`, and
then only on the layers `layer_types` marks sliding (those from `max_window_layers` on), the
others seeing every key; a window no layer uses is none. Greedy output token-exact with
transformers on prompts past the window, chunked and whole (the C++ decode loop, which attends
with one window, is skipped for such a model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_variants import check_greedy, random_prompts
from checkpoint_variants import variant as _variant

from engine import LLM
from engine.config import FULL, SLIDING, ModelConfig

WINDOW = 16


def _windowed(src: Path, dst: Path, types: list[str], max_window_layers: int) -> Path:
    return _variant(
        src, dst, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=max_window_layers, layer_types=types,
    )  # fmt: skip


@pytest.fixture(scope="module")
def mixed(make_tiny_model, tmp_path_factory) -> Path:
    """The tiny qwen2 (2 layers): layer 0 full, layer 1 within a 16-token window."""
    root = tmp_path_factory.mktemp("qwen2-window")
    return _windowed(make_tiny_model("qwen2"), root / "model", [FULL, SLIDING], 1)


def test_the_config_reads_which_layers_slide(make_tiny_model, mixed, tmp_path):
    cfg = ModelConfig.from_pretrained(mixed)
    assert (cfg.sliding_window, cfg.layer_types) == (WINDOW, (FULL, SLIDING))
    assert [cfg.window_of(i) for i in range(2)] == [None, WINDOW]
    src = make_tiny_model("qwen2")
    none = ModelConfig.from_pretrained(_windowed(src, tmp_path / "none", [FULL, FULL], 2))
    every = ModelConfig.from_pretrained(_windowed(src, tmp_path / "all", [SLIDING] * 2, 0))
    off = ModelConfig.from_pretrained(
        _variant(src, tmp_path / "off", use_sliding_window=False, sliding_window=WINDOW)
    )
    assert none.sliding_window is None and off.sliding_window is None
    assert (every.sliding_window, every.layer_types) == (WINDOW, ())  # one window for all


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_only_the_sliding_layers_window_matches_hf(mixed, chunked):
    llm = LLM(
        mixed, dtype="float32", enable_chunked_prefill=chunked,
        max_num_batched_tokens=32 if chunked else 128, enable_prefix_caching=False,
    )  # fmt: skip
    check_greedy(llm, mixed, random_prompts((60, 5, 23, 40)), 16)


def test_the_layer_types_change_transformers_output(make_tiny_model, mixed, tmp_path):
    """Not vacuous: past the window, one sliding layer changes the logits, and windowing
    both layers changes them again."""
    from transformers import AutoModelForCausalLM

    src = make_tiny_model("qwen2")
    every = _windowed(src, tmp_path / "all", [SLIDING] * 2, 0)
    ids = torch.randint(3, 1000, (1, 60), generator=torch.Generator().manual_seed(1))
    logits = []
    for path in (src, mixed, every):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(ids).logits[0, -1])
    assert not torch.allclose(logits[0], logits[1]) and not torch.allclose(logits[1], logits[2])
