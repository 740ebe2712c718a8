"""llama.cpp for benchmarks/llamacpp_compare.py: built from the `llama-cpp-python` sdist, and
the same weights as tandem serves, converted to its formats.

llama.cpp is an optional benchmark dependency, never part of `make setup`: the sdist
(`pip download --no-deps --no-binary :all: llama-cpp-python==VERSION`) carries the C++ source
under `vendor/llama.cpp` (and its git metadata, so the build names its commit). What this
module does, each step once per cache folder (`~/.cache/tandem/llamacpp/<version>/`):
1. `ensure_sdist`: the sdist (`--sdist PATH`, else the cache, else pip download), unpacked;
2. `build`: cmake + ninja, Release, `-march=native` (GGML_NATIVE), static, only the targets
   the comparison runs (llama-bench, llama-server, llama-quantize), `-j2` under `nice -n 10`
   (the box's two cores are shared), with ninja's `[n/total]` lines as progress;
3. `prepare_weights`: the GGUF file tandem serves (SmolLM2-135M-Instruct, Q4_1), read the way
   tandem's loader reads it (engine/gguf_file.py: `gguf`'s own dequantize, q/k rows back in
   transformers' order), written as a Hugging Face safetensors folder in bf16 (config and
   tokenizer from `converted_metadata`); llama.cpp's own `convert_hf_to_gguf.py` turns that
   folder into GGUF bf16 and `llama-quantize` that into Q8_0. tandem loads the folder.

Why bf16 on disk: both engines then start from the same bf16 values; nothing is rounded twice.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python; its vendor/llama.cpp is what is built
TARGETS = ("llama-bench", "llama-server", "llama-quantize")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # -march=native: AVX512(-BF16) where the CPU has it
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # no download of the web UI: nothing is fetched
)


class BuildError(RuntimeError):
    """llama.cpp could not be fetched, built or run: the message says what to install or do."""


def log(msg: str) -> None:
    print(msg, flush=True)


def cache_dir(version: str = VERSION) -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "tandem" / "llamacpp" / version


@dataclass(frozen=True)
class Layout:
    """Where everything lives under one cache folder."""

    root: Path
    version: str = VERSION

    @property
    def sdist(self) -> Path:
        return self.root / f"llama_cpp_python-{self.version}.tar.gz"

    @property
    def source(self) -> Path:
        return self.root / f"llama_cpp_python-{self.version}" / "vendor" / "llama.cpp"

    @property
    def build(self) -> Path:
        return self.root / "build"

    @property
    def weights(self) -> Path:
        return self.root / "smollm2"

    def binary(self, name: str) -> Path:
        return self.build / "bin" / name

    def built(self) -> bool:
        return all(self.binary(t).is_file() for t in TARGETS)


# --------------------------------------------------------------------------- fetch and build


def ensure_sdist(layout: Layout, given: str | None = None) -> Path:
    """The unpacked source folder: from `given`, the cache, or `pip download`."""
    if layout.source.is_dir():
        return layout.source
    layout.root.mkdir(parents=True, exist_ok=True)
    if given:
        shutil.copy(given, layout.sdist)
    if not layout.sdist.is_file():
        log(f"llama.cpp: downloading the llama-cpp-python {layout.version} sdist (pip)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        cmd += ["--dest", str(layout.root), f"llama-cpp-python=={layout.version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not layout.sdist.is_file():
            raise BuildError(
                f"could not download llama-cpp-python=={layout.version} "
                f"(pass --sdist PATH to a downloaded one):\n{proc.stderr[-2000:]}"
            )
    log(f"llama.cpp: unpacking {layout.sdist.name}")
    with tarfile.open(layout.sdist) as tar:
        tar.extractall(layout.root, filter="data")
    if not (layout.source / "CMakeLists.txt").is_file():
        raise BuildError(f"{layout.sdist} has no vendor/llama.cpp/CMakeLists.txt")
    return layout.source


def check_tools() -> dict[str, str]:
    """cmake, ninja and a C++ compiler, or a BuildError naming what is missing."""
    found = {"cmake": shutil.which("cmake"), "ninja": shutil.which("ninja")}
    found["c++"] = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    missing = [name for name, path in found.items() if not path]
    if missing:
        raise BuildError(
            f"building llama.cpp needs {', '.join(missing)} on PATH (e.g. `apt-get install "
            "cmake ninja-build g++`), or pass --skip-build with binaries already in "
            f"{cache_dir()}/build/bin"
        )
    return {k: str(v) for k, v in found.items()}


def _run_with_progress(cmd: list[str], log_path: Path, every: int = 20) -> None:
    """Run `cmd`, its output to `log_path`, echoing ninja's `[n/total]` every `every` steps."""
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if line.startswith("[") and "/" in line.split("]")[0]:
                done, total = line[1:].split("]")[0].split("/")
                if int(done) % every == 0 or done == total:
                    log(f"llama.cpp build: {done}/{total}")
        code = proc.wait()
    if code != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise BuildError(f"`{' '.join(cmd[:4])} ...` failed (exit {code}), see {log_path}:\n{tail}")


def build(layout: Layout, jobs: int = 2) -> None:
    """Configure and build TARGETS (nice'd, `jobs` at a time); a no-op once built."""
    if layout.built():
        return
    tools = check_tools()
    nice = ["nice", "-n", "10"]
    configure = nice + [tools["cmake"], "-S", str(layout.source), "-B", str(layout.build)]
    configure += ["-G", "Ninja", *CMAKE_FLAGS]
    log(f"llama.cpp: configuring ({' '.join(CMAKE_FLAGS[:2])}) in {layout.build}")
    layout.build.mkdir(parents=True, exist_ok=True)
    _run_with_progress(configure, layout.build / "configure.log")
    log(f"llama.cpp: building {', '.join(TARGETS)} with -j{jobs} (several minutes on 2 cores)")
    compile_ = nice + [tools["ninja"], "-C", str(layout.build), f"-j{jobs}", *TARGETS]
    _run_with_progress(compile_, layout.build / "build.log")
    if not layout.built():
        raise BuildError(f"the build finished but {layout.build / 'bin'} lacks a target")


def source_commit(layout: Layout) -> str:
    """The llama.cpp commit the sdist vendors (its git metadata ships with it)."""
    proc = subprocess.run(
        ["git", "-C", str(layout.source), "log", "-1", "--format=%H %cs"],
        capture_output=True,
        text=True,
    )
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


# --------------------------------------------------------------------------- the weights


@dataclass(frozen=True)
class Weights:
    hf_dir: Path  # safetensors, bf16: what tandem loads
    bf16_gguf: Path
    q8_0_gguf: Path


def write_hf_dir(gguf_path: Path, out: Path) -> None:
    """The GGUF file's weights as tandem's loader reads them, saved as a bf16 HF folder."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.gguf_file import COMPLETE_MARKER, GGUFCheckpoint, converted_metadata

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    meta = converted_metadata(str(gguf_path))
    for f in meta.iterdir():
        if f.is_file() and f.name != COMPLETE_MARKER:
            shutil.copy(f, tmp / f.name)
    cfg = AutoConfig.from_pretrained(meta)
    with torch.device("meta"):  # only the parameter names
        names = list(AutoModelForCausalLM.from_config(cfg).state_dict())
    ckpt = GGUFCheckpoint(str(gguf_path), names, cfg.num_attention_heads, cfg.num_key_value_heads)
    # A tied head is not in the file (nor in the folder: tie_word_embeddings says so).
    tensors = {n: ckpt.get(n).to(torch.bfloat16).contiguous() for n in names if n in ckpt.tensors}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    os.rename(tmp, out)


# llama.cpp's converter imports sentencepiece before it looks for tokenizer.model; SmolLM2's
# tokenizer is BPE (no tokenizer.model), so the import is checked after the file instead of
# installing a package the conversion never calls.
_CONVERT_SHIM = """
import os, runpy, sys
script = sys.argv[1]; sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
from conversion import base
cls = next(c for c in vars(base).values()
           if isinstance(c, type) and "_create_vocab_sentencepiece" in vars(c))
orig = cls._create_vocab_sentencepiece
def checked(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(self.dir_model / "tokenizer.model")
    return orig(self)
cls._create_vocab_sentencepiece = checked
runpy.run_path(script, run_name="__main__")
"""


def _checked_run(cmd: list[str], what: str, cwd: Path | None = None) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if proc.returncode != 0:
        raise BuildError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def prepare_weights(layout: Layout, gguf_path: Path) -> Weights:
    """The HF folder, the bf16 GGUF and the Q8_0 GGUF, each made once."""
    w = layout.weights
    weights = Weights(w / "hf-bf16", w / "smollm2-135m-bf16.gguf", w / "smollm2-135m-q8_0.gguf")
    w.mkdir(parents=True, exist_ok=True)
    if not (weights.hf_dir / "model.safetensors").is_file():
        log(f"weights: {gguf_path.name} -> bf16 safetensors (tandem's GGUF reader)")
        write_hf_dir(gguf_path, weights.hf_dir)
    if not weights.bf16_gguf.is_file():
        log("weights: safetensors -> GGUF bf16 (llama.cpp's convert_hf_to_gguf.py)")
        tmp = weights.bf16_gguf.with_suffix(".tmp")
        script = str(layout.source / "convert_hf_to_gguf.py")
        cmd = [sys.executable, "-c", _CONVERT_SHIM, script, str(weights.hf_dir)]
        _checked_run(cmd + ["--outtype", "bf16", "--outfile", str(tmp)], "convert_hf_to_gguf")
        os.rename(tmp, weights.bf16_gguf)
    if not weights.q8_0_gguf.is_file():
        log("weights: GGUF bf16 -> Q8_0 (llama-quantize)")
        tmp = weights.q8_0_gguf.with_suffix(".tmp")
        cmd = [str(layout.binary("llama-quantize")), str(weights.bf16_gguf), str(tmp), "Q8_0"]
        _checked_run(["nice", "-n", "10", *cmd], "llama-quantize")
        os.rename(tmp, weights.q8_0_gguf)
    return weights
