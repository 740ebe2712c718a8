"""Shared fixtures: seeded tiny checkpoints made once per session with `tandem make-model`."""

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
    from engine.make_model import make_model

    made: dict[tuple[str, str, int], Path] = {}

    def get(arch: str = "llama", preset: str = "tiny", seed: int = 0) -> Path:
        key = (arch, preset, seed)
        if key not in made:
            out = tmp_path_factory.mktemp(f"{arch}-{preset}-{seed}")
            made[key] = Path(make_model(out, arch=arch, preset=preset, seed=seed))
        return made[key]

    return get
