"""GGUF checkpoints (llama.cpp's one-file format) served like a Hugging Face directory.

A model path ending in `.gguf` is one file that holds the config, the tokenizer, the chat
template and the weights. What reads it:
- the config and the tokenizer: transformers' own GGUF readers (`AutoConfig` / `AutoTokenizer`
  with `gguf_file=`), plus what they leave out (`_fix_config`: the head size, llama-3 rope
  scaling), saved once per file version as a folder that every later reader loads in ~0.2 s
  (`converted_metadata`); `hf_source(path)` points transformers at it (engine/model_info.py);
  the folder also holds the file's tensor index, so a worker maps its weights without
  parsing the metadata again (`gguf.GGUFReader` reads every field: ~8 s of CPU per process
  for a 49k-token vocabulary);
- the weights: `GGUFCheckpoint`, which engine/loader.py reads like a safetensors checkpoint
  (`where`, `get`): each tensor is dequantized to float32 by the `gguf` package's own
  `dequantize` (no dequantizer of ours), named as transformers names it (`gguf`'s
  `TensorNameMap`, the table llama.cpp's converter writes with), and for the llama
  architecture the q/k rows are put back in transformers' rotary order (llama.cpp's converter
  interleaves them).

Before transformers first reads a file version, `check_gguf` opens it and checks the fields a
config is built from: transformers fills a missing field with the architecture's default (a
missing head count would quietly become 32), so a damaged or unsupported file must fail here,
with the file and the field or tensor named.

Importing this module does not import `gguf` or torch (the router imports model_info).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GGUF_SUFFIX = ".gguf"
# The GGUF architectures tandem serves. llama.cpp writes Mistral as "llama" (transformers
# tells them apart by general.name, then `architecture_of` by the config's model_type).
ARCHITECTURES = ("llama", "qwen2", "qwen3")
# A config's model_type -> the transformers class tandem builds for it.
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Metadata a config cannot be built without (`{arch}.` prefixed).
REQUIRED_FIELDS = (
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
)
COMPLETE_MARKER = ".complete"  # written last into a converted metadata folder
TENSOR_INDEX = "gguf_tensors.json"  # in that folder: where each tensor lies in the file
FOLDER_FORMAT = "t1"  # in the folder's name: folders made before the tensor index are not read
# Tensors llama.cpp stores that transformers computes from the config instead (llama-3's
# scaled rotary frequencies): read past, not loaded.
DERIVED_TENSORS = ("rope_freqs.weight",)


class GGUFError(ValueError):
    """A GGUF file tandem cannot serve; the message names the file and what is wrong."""


def is_gguf(model: str | Path) -> bool:
    return str(model).endswith(GGUF_SUFFIX)


def hf_source(model: str | Path) -> tuple[str, dict[str, Any]]:
    """(path, kwargs) for transformers' `from_pretrained`: a directory is itself; a GGUF file
    is the folder its metadata was converted into (`converted_metadata`)."""
    if not is_gguf(model):
        return str(model), {}
    return str(converted_metadata(str(model))), {}


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/tandem/gguf` (else `~/.cache/tandem/gguf`)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "tandem" / "gguf"


def converted_metadata(path: str) -> Path:
    """A folder holding the GGUF file's config.json and tokenizer, as transformers' GGUF
    readers build them (with `_fix_config`'s corrections), and the file's tensor index
    (`_write_tensor_index`), made once per file version.

    Why a folder: those readers parse every metadata field, the whole vocabulary included,
    which takes ~10 s for a 49k-token vocabulary, and the router, each worker and `LLM` all
    ask; saved once, every later reader takes ~0.2 s. The folder is named by the file's name,
    size and mtime, written under a temporary name and renamed (processes race at start-up).
    An existing folder is the file's check passed (`check_gguf` ran before it was made), so
    the file is not parsed again."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    out = _converted_folder(path)
    if (out / COMPLETE_MARKER).is_file():
        return out
    arch = check_gguf(path)
    from transformers import AutoConfig, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        # The file alone in a folder (a link): beside a tokenizer.json, transformers would read
        # that instead of the file's own vocabulary.
        name = Path(path).name
        (tmp / name).symlink_to(Path(path).resolve())
        config = AutoConfig.from_pretrained(str(tmp), gguf_file=name)
        _fix_config(config, _reader(path), path, arch)
        tokenizer = AutoTokenizer.from_pretrained(str(tmp), gguf_file=name)
        (tmp / name).unlink()
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _write_tensor_index(tmp, _reader(path), path, arch)
        (tmp / COMPLETE_MARKER).write_text(path + "\n")
        os.rename(tmp, out)
    except OSError:
        if not (out / COMPLETE_MARKER).is_file():  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _converted_folder(path: str) -> Path:
    st = os.stat(path)
    return cache_root() / f"{Path(path).name}-{st.st_size}-{st.st_mtime_ns}-{FOLDER_FORMAT}"


def _write_tensor_index(folder: Path, reader, path: str, arch: str) -> None:
    """Where each tensor lies in the file (`TENSOR_INDEX`), so that a worker maps its weights
    without parsing the metadata again (`GGUFReader` reads every field, the vocabulary
    included: ~8 s of CPU per process for SmolLM2). Not written for a file of the other byte
    order (its tensors are read through the reader)."""
    if reader.byte_order != "I":
        return
    tensors = [
        [t.name, int(t.tensor_type), int(t.data_offset), t.data.dtype.str, int(t.data.size)]
        + [list(t.data.shape)]
        for t in reader.tensors
    ]
    index = {"arch": arch, "block_count": _field(reader, path, f"{arch}.block_count")}
    (folder / TENSOR_INDEX).write_text(json.dumps({**index, "tensors": tensors}))


@dataclass(frozen=True)
class MappedTensor:
    """A tensor of the file as `GGUFReader` gives it (name, type, data: a view of the mapped
    file, shaped as the reader shapes it), read from the tensor index."""

    name: str
    tensor_type: Any
    data: Any


def _indexed_tensors(path: str) -> tuple[str, int, list[MappedTensor]] | None:
    """(architecture, block count, tensors) from the converted folder's index, or None."""
    index_file = _converted_folder(path) / TENSOR_INDEX
    if not index_file.is_file():
        return None
    import gguf
    import numpy as np

    index = json.loads(index_file.read_text())
    data = np.memmap(path, mode="r")
    tensors = []
    for name, qtype, offset, dtype, count, shape in index["tensors"]:
        end = offset + np.dtype(dtype).itemsize * count
        if end > data.size:
            raise GGUFError(f"{path}: tensor {name!r} runs past the end of the file")
        view = data[offset:end].view(dtype).reshape(shape)
        tensors.append(MappedTensor(name, gguf.GGMLQuantizationType(qtype), view))
    return index["arch"], index["block_count"], tensors


def _fix_config(config: Any, reader, path: str, arch: str) -> None:
    """What transformers' GGUF config reader leaves out (as of 5.x): the head size a file
    states (`attention.key_length`; Qwen3 would get its default of 128), the architecture
    name, and llama-3 rope scaling, which llama.cpp stores as a tensor of per-frequency
    divisors (`rope_freqs.weight`) rather than as metadata."""
    config.architectures = [architecture_of(config)]
    key_length = _field(reader, path, f"{arch}.attention.key_length", required=False)
    if key_length:
        config.head_dim = int(key_length)
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return
    import numpy as np

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") or getattr(
        config, "rope_theta", 10000.0
    )
    rope = llama3_rope(np.asarray(freqs.data, dtype=np.float64), float(theta), head_dim)
    if rope is None:
        raise GGUFError(
            f"{path}: tensor 'rope_freqs.weight' is not llama-3 rope scaling (low/high "
            "frequency factors 1 and 4); tandem serves no other rope_freqs"
        )
    config.rope_parameters = rope


def _reader(path: str):
    """The file's parsed metadata and tensor index (memory-mapped), one per file version in a
    process: parsing reads every field, the whole vocabulary included, and the config check,
    the metadata conversion and the weight loader all need it."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    st = os.stat(path)
    return _open_reader(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _open_reader(path: str, mtime_ns: int, size: int):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - numpy/struct errors of a damaged file, named below
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def _field(reader, path: str, key: str, required: bool = True) -> Any:
    """One metadata value (a str, a number, or a list of them); GGUFError when required and
    absent or unreadable."""
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise GGUFError(f"{path}: metadata field {key!r} is missing")
        return None
    try:
        return field.contents()
    except Exception as e:  # noqa: BLE001 - a field whose bytes do not parse
        raise GGUFError(f"{path}: metadata field {key!r} is unreadable ({e})") from e


def check_gguf(path: str) -> str:
    """The file's GGUF architecture, after checking it is one tandem serves and that the
    metadata a config needs is there (GGUFError naming the field otherwise)."""
    reader = _reader(path)
    arch = _field(reader, path, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: metadata field 'general.architecture' is {arch!r}; tandem serves "
            f"{sorted(ARCHITECTURES)}"
        )
    experts = _field(reader, path, f"{arch}.expert_count", required=False)
    if experts:  # llama.cpp writes Mixtral as "llama" with experts
        raise GGUFError(
            f"{path}: metadata field '{arch}.expert_count' is {experts!r}; mixture-of-experts "
            "GGUF files are not supported (serve the Hugging Face directory)"
        )
    for name in REQUIRED_FIELDS:
        value = _field(reader, path, f"{arch}.{name}")
        if not isinstance(value, int) or value <= 0:
            raise GGUFError(f"{path}: metadata field '{arch}.{name}' is {value!r}, not a count")
    for name in ("tokenizer.ggml.model", "tokenizer.ggml.tokens"):
        _field(reader, path, name)
    return arch


def architecture_of(hf_config: Any) -> str:
    """The transformers class name for a config read from a GGUF file (transformers leaves
    `architectures` unset there), from its model_type."""
    archs = getattr(hf_config, "architectures", None) or []
    if archs:
        return archs[0]
    return MODEL_TYPES.get(getattr(hf_config, "model_type", ""), "")


def served_name(model: str) -> str:
    """A GGUF file's default served model name: the file's name without `.gguf`."""
    return Path(model).name.removesuffix(GGUF_SUFFIX)


def _reverse_permute(w, n_head: int):
    """Undo llama.cpp's q/k row interleave: per head, its converter stores the rotary pairs
    (i, i + d/2) side by side; transformers' rotate_half wants the halves apart."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_divisors(wl, factor: float, low: float, high: float, orig: float):
    """The divisor of each rope frequency under llama-3 scaling (transformers' formula)."""
    import numpy as np

    smooth = (orig / wl - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wl < orig / high, 1.0, np.where(wl > orig / low, factor, mid))


def llama3_rope(divisors, theta: float, head_dim: int) -> dict | None:
    """transformers' llama-3 rope parameters that give `divisors` (llama.cpp's rope_freqs),
    with Meta's frequency factors (low 1, high 4) and the original context solved for; None
    when no such parameters reproduce them."""
    import numpy as np

    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wl = 2 * np.pi / inv
    factor = float(divisors.max())
    if divisors.shape != wl.shape or factor <= 1.0:
        return None
    low, high = 1.0, 4.0
    mid = (divisors > 1 + 1e-6) & (divisors < factor - 1e-6)
    if mid.any():
        smooth = (1 / divisors[mid] - 1 / factor) / (1 - 1 / factor)
        orig = float(np.median(wl[mid] * (low + smooth * (high - low))))
    else:  # no frequency between the bands: any context between the band edges fits
        orig = float(wl[divisors <= 1 + 1e-6].max(initial=0.0) * high) + 1.0
    orig = float(round(orig))
    if not np.allclose(_llama3_divisors(wl, factor, low, high, orig), divisors, rtol=1e-4):
        return None
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": int(orig),
    }


class GGUFCheckpoint:
    """A GGUF file's tensors by their transformers names (engine/loader.py's checkpoint
    interface: `path`, `where` (name -> GGUF tensor name), `get(name)` -> float32 tensor)."""

    def __init__(self, path: str, hf_names: list[str], num_heads: int, num_kv_heads: int):
        import gguf

        self.path = path
        indexed = _indexed_tensors(path)
        if indexed is None:
            self.arch = arch = check_gguf(path)
            reader = _reader(path)
            n_blocks, tensors = _field(reader, path, f"{arch}.block_count"), reader.tensors
        else:
            arch, n_blocks, tensors = indexed
            self.arch = arch
        self.heads = {"attn_q": num_heads, "attn_k": num_kv_heads}
        arch_enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
        names = gguf.get_tensor_name_map(arch_enum, n_blocks)
        to_hf = {}
        for hf_name in hf_names:
            gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if gguf_name is not None:
                to_hf[gguf_name] = hf_name
        self.tensors = {}
        self.where: dict[str, str] = {}
        for t in tensors:
            if t.name in DERIVED_TENSORS:
                continue
            hf_name = to_hf.get(t.name)
            if hf_name is None:
                raise GGUFError(f"{path}: tensor {t.name!r} is not one of a {arch} model's")
            self.tensors[hf_name] = t
            self.where[hf_name] = t.name

    def get(self, name: str):
        import gguf
        import numpy as np
        import torch

        t = self.tensors[name]
        try:
            values = gguf.dequantize(t.data, t.tensor_type)
        except Exception as e:  # noqa: BLE001 - an unsupported or damaged type, named
            raise GGUFError(
                f"{self.path}: tensor {t.name!r} ({t.tensor_type.name}) cannot be read: {e}"
            ) from e
        values = np.ascontiguousarray(values, dtype=np.float32)
        kind = t.name.split(".")[-2] if t.name.count(".") >= 2 else ""
        if self.arch == "llama" and kind in self.heads:
            values = _reverse_permute(values, self.heads[kind])  # a new, contiguous array
        # An F32 tensor comes back as a read-only view of the mapped file: copied, so the
        # tensor owns memory it may write (the load then copies it into the model anyway).
        return torch.from_numpy(values if values.flags.writeable else values.copy())
