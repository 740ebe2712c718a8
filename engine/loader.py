"""Build a model and fill its weights: from a local Hugging Face directory (safetensors,
sharded or not, with a progress bar) or, with `load_format="dummy"`, from a seeded RNG."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from tqdm import tqdm

from engine.config import ModelConfig
from engine.models import CausalLM

LOAD_FORMATS = ("auto", "dummy")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def build_model(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, load_format: str, seed: int
) -> CausalLM:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    with torch.device(device), _default_dtype(dtype):
        model = CausalLM(cfg)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_safetensors(model, cfg.path)
    return model.eval().requires_grad_(False)


def init_dummy_weights(model: CausalLM, seed: int) -> None:
    """Seeded random weights: N(0, 0.02) matrices, norms near 1 (so they matter)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                val = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif name.endswith("bias"):
                val = 0.02 * torch.randn(p.shape, generator=gen)
            else:
                val = 0.02 * torch.randn(p.shape, generator=gen)
            p.copy_(val.to(p.dtype))


def _shard_files(path: str) -> list[Path]:
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [root / f for f in sorted(set(weight_map.values()))]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def _target(model: CausalLM, hf_name: str) -> tuple[str, int | None]:
    """Our parameter name for an HF weight name, and its shard index if fused."""
    for fused, parts in model.packed_modules.items():
        for idx, part in enumerate(parts):
            if f".{part}." in hf_name:
                return hf_name.replace(f".{part}.", f".{fused}."), idx
    return hf_name, None


def _shard_slice(model: CausalLM, fused_name: str, idx: int) -> tuple[int, int]:
    cfg = model.cfg
    if ".qkv_proj." in fused_name:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        sizes = [q, kv, kv]
    else:
        sizes = [cfg.intermediate_size] * 2
    start = sum(sizes[:idx])
    return start, start + sizes[idx]


def load_safetensors(model: CausalLM, path: str) -> None:
    from safetensors import safe_open

    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {n for n in params if not (model.cfg.tie_word_embeddings and n == "lm_head.weight")}
    loaded: set[str] = set()
    files = _shard_files(path)
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            total += len(list(fh.keys()))
    with torch.no_grad(), tqdm(total=total, desc="loading weights", unit="tensor") as bar:
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for hf_name in fh.keys():
                    bar.update()
                    if "rotary_emb.inv_freq" in hf_name:
                        continue
                    name, idx = _target(model, hf_name)
                    if name not in params:
                        if model.cfg.tie_word_embeddings and hf_name == "lm_head.weight":
                            continue
                        raise ValueError(f"unexpected weight {hf_name!r} in {f.name}")
                    tensor = fh.get_tensor(hf_name)
                    param = params[name]
                    dst = param if idx is None else param[slice(*_shard_slice(model, name, idx))]
                    if dst.shape != tensor.shape:
                        raise ValueError(
                            f"{hf_name}: shape {tuple(tensor.shape)} != {tuple(dst.shape)}"
                        )
                    dst.copy_(tensor.to(dst.dtype))
                    loaded.add(name)
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {sorted(missing)[:5]}")
