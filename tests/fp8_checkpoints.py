"""FP8 checkpoints for tests, in the on-disk layouts users download: a full-precision Hugging
Face directory (a tiny `make_model` checkpoint) converted to

- compressed-tensors `float-quantized` (`write_compressed_tensors`), the config llm-compressor
  writes for its FP8_DYNAMIC (channel weights, dynamic per-token inputs), FP8 (per-tensor
  weights, static per-tensor inputs with calibrated `input_scale`s) and FP8_BLOCK (128x128
  weight blocks, dynamic per-token-group inputs) schemes, or weight-only (no
  `input_activations`): `<layer>.weight` e4m3 and `<layer>.weight_scale` (multiply to
  dequantize) in the original weights' dtype;
- `quant_method: fp8` block-wise (`write_block_fp8`), as the DeepSeek / Qwen3 FP8 releases
  ship: `<layer>.weight` e4m3 and fp32 `<layer>.weight_scale_inv` per 128x128 block (also a
  multiplier, despite the name); ragged last blocks take the amax of the partial block;
- and back (`write_dequantized`): every e4m3 weight times its scales in fp32, no
  quantization_config, so Hugging Face transformers loads the very weights the FP8 checkpoint
  holds and tests compare the engine against it on the same numbers.

Only the decoder layers' projections (q/k/v/o_proj, gate/up/down_proj) are quantized;
embeddings, norms, biases and lm_head are copied unchanged, as are the tokenizer files and
generation_config.json. The math here is written independently of engine.quantization so a
mistake there cannot cancel out in the tests.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Serialized compressed-tensors QuantizationArgs: every field, with its default.
_ARGS_DEFAULTS = {
    "actorder": None,
    "block_structure": None,
    "dynamic": False,
    "group_size": None,
    "num_bits": 8,
    "observer": "minmax",
    "observer_kwargs": {},
    "strategy": "tensor",
    "symmetric": True,
    "type": "float",
}
_INPUT_STRATEGY = {"channel": "token", "tensor": "tensor", "block": "group"}


def is_projection(name: str) -> bool:
    """Whether tensor `name` is a decoder-layer projection weight (what gets quantized)."""
    parts = name.split(".")
    return (
        name.startswith("model.layers.")
        and name.endswith(".weight")
        and len(parts) >= 2
        and parts[-2] in PROJECTIONS
    )


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory's *.safetensors files."""
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                out[key] = handle.get_tensor(key)
    return out


def read_config(path: str | Path) -> dict:
    return json.loads(Path(path, "config.json").read_text())


def _write(dst: str | Path, src: str | Path, config: dict, tensors: dict) -> Path:
    """dst with `config` as config.json, `tensors` as model.safetensors, and every other file
    of src (tokenizer, chat template, generation_config.json) copied."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        skip = f.suffix == ".safetensors" or f.name in (
            "config.json",
            "model.safetensors.index.json",
        )
        if f.is_file() and not skip and not f.name.startswith("."):
            shutil.copy2(f, dst / f.name)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    save_file(contiguous, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _cast(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w / scale (broadcast, fp32), saturated and rounded to e4m3."""
    return (w.float() / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _positive(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448, with an all-zero group given scale 1 (its values quantize to 0 anyway)."""
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The amax of every (block[0] x block[1]) block of w [N, K], the ragged last row/column
    blocks over their partial extent: [ceil(N / rows), ceil(K / cols)] fp32."""
    rows, cols = block
    n, k = w.shape
    gn, gk = math.ceil(n / rows), math.ceil(k / cols)
    out = torch.empty(gn, gk, dtype=torch.float32)
    a = w.float().abs()
    for i in range(gn):
        for j in range(gk):
            out[i, j] = a[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols].max()
    return out


def expand_blocks(s: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """A [ceil(N/rows), ceil(K/cols)] block scale broadcast to [n, k]."""
    rows, cols = block
    return s.float().repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]


def quantize(w: torch.Tensor, weights: str, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale in w's dtype) for strategy `weights`: "channel" ([N, 1]), "tensor"
    ([1]) or "block" ([ceil(N/rows), ceil(K/cols)]); w ~= q * scale (broadcast per block).
    The weight is divided by the scale as stored (rounded to w's dtype), so the stored pair is
    consistent."""
    n, k = w.shape
    if weights == "channel":
        scale = _positive(w.float().abs().amax(dim=1, keepdim=True)).to(w.dtype)
        return _cast(w, scale), scale
    if weights == "tensor":
        scale = _positive(w.float().abs().amax().reshape(1)).to(w.dtype)
        return _cast(w, scale), scale
    if weights == "block":
        scale = _positive(block_amax(w, block)).to(w.dtype)
        return _cast(w, expand_blocks(scale, block, n, k)), scale
    raise ValueError(f"weights must be channel, tensor or block, got {weights!r}")


def _args(**fields) -> dict:
    return {**_ARGS_DEFAULTS, **fields}


def compressed_tensors_config(weights: str, activations: str | None, block=(128, 128)) -> dict:
    """The `quantization_config` llm-compressor writes for FP8_DYNAMIC (channel, dynamic),
    FP8 (tensor, static), FP8_BLOCK (block, dynamic) or a weight-only FP8 scheme (None)."""
    w = _args(strategy=weights)
    if weights == "block":
        w["block_structure"] = list(block)
    group = {
        "format": "float-quantized",
        "input_activations": None,
        "output_activations": None,
        "targets": ["Linear"],
        "weights": w,
    }
    if activations is not None:
        if activations not in ("dynamic", "static"):
            raise ValueError(f"activations must be dynamic, static or None, got {activations!r}")
        dynamic = activations == "dynamic"
        strategy = _INPUT_STRATEGY[weights] if dynamic else "tensor"
        group["input_activations"] = _args(
            strategy=strategy,
            dynamic=dynamic,
            observer=None if dynamic else "static_minmax",
            group_size=block[1] if strategy == "group" else None,
        )
    return {
        "config_groups": {"group_0": group},
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "version": "0.12.2",
    }


def calibrate_input_amax(src: str | Path, tokens: int = 64, seed: int = 0) -> dict[str, float]:
    """The amax of every decoder projection's input over `tokens` random token ids through
    the full-precision model (transformers): what a static_minmax observer records."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and is_projection(f"{name}.weight"):

            def hook(_m, args, name=name):
                amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))

            hooks.append(mod.register_forward_pre_hook(hook))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (1, tokens), generator=g)
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return amax


def write_compressed_tensors(
    src: str | Path,
    dst: str | Path,
    weights: str = "channel",
    activations: str | None = "dynamic",
    block: tuple[int, int] = (128, 128),
) -> Path:
    """src converted to a compressed-tensors float-quantized checkpoint at dst (see module)."""
    config = read_config(src)
    config["quantization_config"] = compressed_tensors_config(weights, activations, block)
    amax = calibrate_input_amax(src) if activations == "static" else {}
    tensors = {}
    for name, t in read_tensors(src).items():
        if not is_projection(name):
            tensors[name] = t
            continue
        q, scale = quantize(t, weights, block)
        layer = name.removesuffix(".weight")
        tensors[name], tensors[f"{layer}.weight_scale"] = q, scale
        if activations == "static":
            value = _positive(torch.tensor([amax[layer]], dtype=torch.float32))
            tensors[f"{layer}.input_scale"] = value.to(t.dtype)
    return _write(dst, src, config, tensors)


def write_block_fp8(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128)) -> Path:
    """src converted to a `quant_method: fp8` block-wise checkpoint at dst (see module)."""
    config = read_config(src)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    tensors = {}
    for name, t in read_tensors(src).items():
        if not is_projection(name):
            tensors[name] = t
            continue
        q, scale = quantize(t.float(), "block", block)
        tensors[name] = q
        tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale.float()
    return _write(dst, src, config, tensors)


def _block_of(qcfg: dict) -> tuple[int, int] | None:
    if qcfg.get("quant_method") == "fp8":
        size = qcfg.get("weight_block_size")
        return tuple(size) if size else None
    for group in qcfg["config_groups"].values():
        if group["weights"].get("block_structure"):
            return tuple(group["weights"]["block_structure"])
    return None


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None):
    """q * scale in fp32: scale [N, 1] / [N] (channel), one value (tensor) or per block."""
    n, k = q.shape
    s = scale.float()
    if s.numel() == 1:
        return q.float() * s.reshape(())
    if s.shape in ((n,), (n, 1)):
        return q.float() * s.reshape(n, 1)
    return q.float() * expand_blocks(s, block, n, k)


def write_dequantized(fp8_dir: str | Path, dst: str | Path) -> Path:
    """The reference of an FP8 checkpoint: every e4m3 weight dequantized to fp32 with its
    scale, the scale and input-scale tensors dropped, no quantization_config."""
    config = read_config(fp8_dir)
    qcfg = config.pop("quantization_config")
    block = _block_of(qcfg)
    src = read_tensors(fp8_dir)
    tensors = {}
    for name, t in src.items():
        if name.endswith((".weight_scale", ".weight_scale_inv", ".input_scale")):
            continue
        if t.dtype != E4M3:
            tensors[name] = t
            continue
        base = name.removesuffix("weight")
        scale = src.get(base + "weight_scale")
        scale = src[base + "weight_scale_inv"] if scale is None else scale
        tensors[name] = dequantize(t, scale, block)
    return _write(dst, fp8_dir, config, tensors)


def rewrite(path: str | Path, config=None, drop=(), replace=None) -> Path:
    """Edit a checkpoint in place (malformed-checkpoint tests): `config(dict)` mutates the
    parsed config.json, `drop` names tensors to remove, `replace` maps names to new tensors."""
    path = Path(path)
    if config is not None:
        cfg = read_config(path)
        config(cfg)
        (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if drop or replace:
        tensors = read_tensors(path)
        for name in drop:
            del tensors[name]
        tensors.update(replace or {})
        for f in path.glob("*.safetensors"):
            f.unlink()
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            str(path / "model.safetensors"),
            metadata={"format": "pt"},
        )
    return path
