"""The tiny model every fault case serves (helpers: fault_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def fault_model(make_tiny_model) -> Path:
    return make_tiny_model("llama")
