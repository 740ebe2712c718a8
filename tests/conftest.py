"""Shared fixtures: seeded tiny checkpoints, made once per session by `cached_model`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# Tests must not reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory):
    """`get(arch, preset, seed) -> Path`: the checkpoint, made once per session in pytest's
    temporary directory (never the user's cache, so a test cannot read a stale model)."""
    from engine.make_model import cached_model

    root = tmp_path_factory.mktemp("models")

    def get(arch: str = "llama", preset: str = "tiny", seed: int = 0) -> Path:
        return cached_model(arch, preset, seed, cache_dir=root)

    return get
