"""Build a model and fill its weights: from a local Hugging Face directory (safetensors,
sharded or not, full precision or FP8 (engine.quantization.checkpoint), with a progress bar),
from a GGUF file (engine/gguf_file.py: dequantized to float32, then to the serving dtype) or,
with `load_format="dummy"`, from a seeded RNG; then quantize what the pool asks for."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from tqdm import tqdm

from engine.config import ModelConfig
from engine.gguf_file import GGUFCheckpoint, is_gguf
from engine.models import CausalLM, model_class
from engine.models.linear import Linear
from engine.models.weight_arena import pack_weights
from engine.quantization import fp8
from engine.quantization.checkpoint import FP8Checkpoint

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
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str,
    seed: int,
    quantization: str = "none",
    shard=None,
    group=None,
) -> CausalLM:
    """The model with its weights, its decoder projections in the layout `quantization` (one
    of engine.quantization.RESOLVED) names: an FP8 checkpoint's layers are filled with its own
    FP8 weights and scales; full weights are quantized after loading. With `shard` (an
    engine.models.parallel.Shard) only that rank's slices are built and read, and the
    row-parallel projections all-reduce over `group`."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    with torch.device(device), _default_dtype(dtype):
        model = model_class(cfg)(cfg if shard is None else shard.local_config())
    if shard is not None:
        from engine.models.parallel import make_row_parallel

        make_row_parallel(model, group)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
        model.quantize(quantization)
    elif cfg.fp8_checkpoint is not None:
        # The checkpoint's layout: its FP8 layers, and the layers it ignores stay full.
        prepare_fp8_layers(model, cfg.fp8_checkpoint, activations=quantization == "fp8")
        load_weights(model, cfg.path, shard)
    else:
        load_weights(model, cfg.path, shard)
        model.quantize(quantization)
    if torch.device(device).type == "cpu":
        pack_weights(model)  # one stream for the decode step's weights (weight_arena)
    return model.eval().requires_grad_(False)


def prepare_fp8_layers(model: CausalLM, ckpt: FP8Checkpoint, activations: bool) -> int:
    """Give every decoder projection the checkpoint quantized empty FP8 buffers to load into
    (W8A8 when `activations`, else weight-only); returns how many. A fused projection whose
    parts the checkpoint quantizes differently cannot be fused: that fails, naming it."""
    n = 0
    for name, mod in model.model.layers.named_modules(prefix="model.layers"):
        if not isinstance(mod, Linear):
            continue
        parts = [
            name.replace(f".{fused}", f".{p}")
            for fused, ps in model.packed_modules.items()
            if name.endswith("." + fused)
            for p in ps
        ] or [name]
        ignored = {ckpt.ignored(p) for p in parts}
        if len(ignored) > 1:
            raise ValueError(f"{ckpt.method} checkpoint quantizes only some of {parts}")
        if not ignored.pop():
            static = activations and ckpt.activations == "static"
            mod.empty_fp8(activations, ckpt.block_k, static_input=static)
            n += 1
    return n


def init_dummy_weights(model: CausalLM, seed: int) -> None:
    """Seeded random weights: N(0, 0.02) matrices, norms near 1 (so they matter). Drawn on
    the weights' device (an 8B model's 8G draws take a minute on a CPU generator, well under a
    second on a GPU's); the same seed gives the same weights on the same kind of device."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, device=device)
            if name.endswith("norm.weight"):
                val = 1.0 + 0.1 * noise
            else:  # matrices and biases
                val = 0.02 * noise
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
    else:  # gate | up, halves of the projection's width (a MoE expert's is its own)
        sizes = [model.get_submodule(fused_name.rsplit(".", 1)[0]).out_features // 2] * 2
    start = sum(sizes[:idx])
    return start, start + sizes[idx]


class _Checkpoint:
    """Every tensor name of a (sharded) safetensors checkpoint, readable by name."""

    def __init__(self, path: str, stack: contextlib.ExitStack):
        from safetensors import safe_open

        self.path = path
        self.files = {}
        self.where: dict[str, str] = {}
        for f in _shard_files(path):
            handle = stack.enter_context(safe_open(str(f), framework="pt"))
            self.files[f.name] = handle
            for key in handle.keys():
                self.where[key] = f.name

    def get(self, name: str) -> torch.Tensor:
        return self.files[self.where[name]].get_tensor(name)

    def scale_of(self, ckpt: FP8Checkpoint, scale_name: str, hf_name: str, n: int, k: int):
        """The scales `scale_name` of the [n, k] weight `hf_name`, as the FP8 layers hold them."""
        return ckpt.scale_rows(self.get(scale_name), scale_name, n, k)


def _fused_of(model: CausalLM, name: str) -> str | None:
    """The fused module (`qkv_proj`, `gate_up_proj`) a parameter name belongs to, if any."""
    return next((f for f in model.packed_modules if f".{f}." in name), None)


def _hf_names(model: CausalLM) -> list[str]:
    """The transformers names of the model's weights (fused projections split back into their
    parts, unless the architecture's checkpoints hold them fused; the head always, tied or
    not)."""
    names = {"lm_head.weight"}
    for name, _ in model.named_parameters(remove_duplicate=False):
        fused = _fused_of(model, name)
        if fused is None:
            names.add(name)
        else:
            names.update(name.replace(f".{fused}.", f".{p}.") for p in model.packed_modules[fused])
    return sorted(names)


def _open_checkpoint(model: CausalLM, path: str, stack: contextlib.ExitStack, cfg=None):
    """The weights at `path` by transformers name: a GGUF file or safetensors files. `cfg`:
    the whole model's config when `model` is one rank's (its head counts undo GGUF's q/k
    row order on the whole tensors)."""
    if is_gguf(path):
        cfg = cfg or model.cfg
        return GGUFCheckpoint(path, _hf_names(model), cfg.num_heads, cfg.num_kv_heads)
    return _Checkpoint(path, stack)


def load_weights(model: CausalLM, path: str, shard=None) -> None:
    """Fill `model` from the checkpoint at `path` (safetensors files or a GGUF file); every
    weight it expects must be there, every tensor there must be one it has, in the layout the
    architecture's checkpoints have (`model.packed_modules`: q/k/v and gate/up as parts, or
    fused already, as Phi-3's, which then fill their parameters whole). With `shard`,
    every tensor is read as that rank's slice (engine.models.parallel.ShardedCheckpoint)."""
    ckpt = model.cfg.fp8_checkpoint
    params = dict(model.named_parameters(remove_duplicate=False))
    fp8_layers = {
        f"{name}.weight": mod
        for name, mod in model.named_modules()
        if isinstance(mod, Linear) and mod.scheme == "fp8"
    }
    expected = {n for n in params if not (model.cfg.tie_word_embeddings and n == "lm_head.weight")}
    expected |= set(fp8_layers)
    loaded: set[str] = set()
    with contextlib.ExitStack() as stack, torch.no_grad():
        files = _open_checkpoint(model, path, stack, None if shard is None else shard.cfg)
        if shard is not None:
            from engine.models.parallel import ShardedCheckpoint

            files = ShardedCheckpoint(files, shard)
        names = [n for n in files.where if not n.endswith(_SCALE_SUFFIXES)]
        for hf_name in tqdm(names, desc="loading weights", unit="tensor"):
            if "rotary_emb.inv_freq" in hf_name:
                continue
            stacked = model.stacked_parameters(hf_name)
            if stacked is not None:  # a MoE's experts in one tensor
                _load_stacked(model, params, stacked, hf_name, files, loaded)
                continue
            name, idx = _target(model, model.checkpoint_name(hf_name))
            if idx is None and (fused := _fused_of(model, name)):
                # A fused tensor where this architecture's checkpoints hold its parts.
                raise ValueError(
                    f"unexpected weight {hf_name!r} in {files.where[hf_name]}: "
                    f"{model.cfg.architecture} checkpoints hold {model.packed_modules[fused]}"
                )
            if name in fp8_layers:
                _load_fp8_part(model, fp8_layers[name], name, idx, hf_name, files)
            elif name in params:
                # Gemma's norms hold 1 + w (CausalLM.checkpoint_tensor).
                tensor = model.checkpoint_tensor(name, _full_tensor(files, hf_name, ckpt))
                param = params[name]
                dst = param if idx is None else param[slice(*_shard_slice(model, name, idx))]
                _check_shape(hf_name, tensor, dst.shape)
                dst.copy_(tensor.to(dst.dtype))
            elif model.cfg.tie_word_embeddings and hf_name == "lm_head.weight":
                continue
            else:
                raise ValueError(f"unexpected weight {hf_name!r} in {files.where[hf_name]}")
            _mark_loaded(loaded, name if idx is None else f"{name}[{idx}]", hf_name)
    # A fused projection counts as loaded only with every part: one part missing (an up_proj
    # without its gate_proj) would otherwise leave rows of uninitialised memory.
    fused = {n: len(model.packed_modules[f]) for n in expected if (f := _fused_of(model, n))}
    expected = {n for n in expected if n not in fused}
    expected |= {f"{n}[{i}]" for n, count in fused.items() for i in range(count)}
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {sorted(missing)[:5]}")


_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")


def _mark_loaded(loaded: set[str], key: str, hf_name: str) -> None:
    """Record parameter (part) `key` as filled by `hf_name`: a checkpoint that fills one twice
    (a MoE expert both per expert and in a 3-D tensor) is refused, not read last-wins."""
    if key in loaded:
        raise ValueError(f"{hf_name} fills {key}, which another tensor of the checkpoint fills")
    loaded.add(key)


def _load_stacked(model, params, names: list[str], hf_name: str, files, loaded) -> None:
    """Fill parameters `names` from the 3-D checkpoint tensor `hf_name`, one per index of its
    first dimension (transformers 5's in-memory experts: [experts, gate | up, hidden] and
    [experts, hidden, width], each index a per-expert parameter's layout)."""
    if any(n not in params for n in names):  # experts where this model's layer is dense
        raise ValueError(f"unexpected weight {hf_name!r} in {files.where[hf_name]}")
    tensor = files.get(hf_name)
    if tensor.dim() != 3 or tensor.shape[0] != len(names):
        raise ValueError(
            f"{hf_name}: shape {tuple(tensor.shape)}, expected [{len(names)} experts, rows, cols]"
        )
    for e, name in enumerate(names):
        param = params[name]
        _check_shape(f"{hf_name}[{e}]", tensor[e], param.shape)
        param.copy_(tensor[e].to(param.dtype))
        fused = _fused_of(model, name)
        parts = range(len(model.packed_modules[fused])) if fused else [None]
        for i in parts:
            _mark_loaded(loaded, name if i is None else f"{name}[{i}]", hf_name)


def _check_shape(hf_name: str, tensor: torch.Tensor, shape) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != {tuple(shape)}")


def _scale_of(files: _Checkpoint, hf_name: str, ckpt: FP8Checkpoint, suffix: str) -> str:
    """The name of `hf_name`'s scale tensor (`suffix`); ValueError when the checkpoint lacks it."""
    name = hf_name.removesuffix("weight") + suffix
    if name not in files.where:
        raise ValueError(
            f"checkpoint {files.path} lacks {name}, the scale of {hf_name} ({ckpt.describe()})"
        )
    return name


def _full_tensor(files: _Checkpoint, hf_name: str, ckpt: FP8Checkpoint | None) -> torch.Tensor:
    """A tensor for a full-precision parameter: an FP8 one (a quantized head, say) is
    dequantized with its scale."""
    tensor = files.get(hf_name)
    if not tensor.dtype.is_floating_point or tensor.element_size() != 1:
        return tensor
    if ckpt is None:
        raise ValueError(f"{hf_name} is {tensor.dtype} but config.json has no quantization_config")
    scale_name = _scale_of(files, hf_name, ckpt, ckpt.scale_suffix)
    n, k = tensor.shape
    scale = files.scale_of(ckpt, scale_name, hf_name, n, k)
    return fp8.dequantize_fp8(tensor, scale, ckpt.block_k)


def _load_fp8_part(model, mod: Linear, name, idx, hf_name: str, files: _Checkpoint) -> None:
    """Copy one FP8 weight (a whole projection or one part of a fused one) and its scales."""
    ckpt = model.cfg.fp8_checkpoint
    tensor = files.get(hf_name)
    if tensor.dtype != fp8.FP8:
        raise ValueError(f"{hf_name}: dtype {tensor.dtype}, expected e4m3 ({ckpt.describe()})")
    rows = slice(None) if idx is None else slice(*_shard_slice(model, name, idx))
    dst = mod.qweight[rows]
    _check_shape(hf_name, tensor, dst.shape)
    dst.copy_(tensor)
    scale_name = _scale_of(files, hf_name, ckpt, ckpt.scale_suffix)
    n, k = tensor.shape
    mod.wscale[rows] = files.scale_of(ckpt, scale_name, hf_name, n, k)
    if mod.input_scale is not None:
        # One scale for the fused input: the largest of its parts' (no part saturates).
        input_name = _scale_of(files, hf_name, ckpt, "input_scale")
        value = files.get(input_name).float()
        _expect_scalar(input_name, value)
        mod.input_scale.copy_(torch.maximum(mod.input_scale, value.reshape(())))


def _expect_scalar(name: str, t: torch.Tensor) -> None:
    if t.numel() != 1:
        raise ValueError(f"checkpoint tensor {name}: shape {list(t.shape)}, expected one value")
