"""FP8 checkpoints as users have them: what their `quantization_config` says, checked field by
field, and their scale tensors reshaped to the layout `Linear` keeps.

Two formats:
- compressed-tensors `float-quantized` (what llm-compressor writes; `FP8_DYNAMIC`, `FP8`,
  `FP8_BLOCK`): `quant_method: compressed-tensors`, one config group whose `weights` are
  8-bit floats with a `channel`, `tensor` or `block` strategy (`block_structure`) and whose
  `input_activations` are dynamic per `token` (or per `group` with block weights), static per
  `tensor` (an `input_scale` per layer), or absent (weight-only). Tensors `<layer>.weight`
  (e4m3) and `<layer>.weight_scale`; `ignore` names the layers kept in full precision.
- `quant_method: fp8` (the Qwen3 / DeepSeek FP8 releases, transformers' fine-grained FP8):
  e4m3 weights with `<layer>.weight_scale_inv` per `weight_block_size` block ([128, 128]);
  without a block size, vLLM's serialized per-tensor form (`weight_scale`, optional
  `input_scale`). `modules_to_not_convert` / `ignored_layers` name full-precision layers.

Anything else fails here, at load, with the field or tensor named.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

log = logging.getLogger("tandem.quantization")

WEIGHT_STRATEGIES = ("channel", "tensor", "block")
ACTIVATIONS = ("dynamic", "static", "none")


@dataclass(frozen=True, slots=True)
class FP8Checkpoint:
    """The FP8 layout of a checkpoint's quantized layers."""

    method: str  # "compressed-tensors" or "fp8"
    weights: str  # one of WEIGHT_STRATEGIES
    block: tuple[int, int] | None  # (rows, cols) of a weight-scale block
    activations: str  # one of ACTIVATIONS: how the checkpoint quantizes inputs
    scale_suffix: str  # "weight_scale" or "weight_scale_inv"
    ignore: tuple[str, ...] = ()

    def describe(self) -> str:
        block = f" {self.block[0]}x{self.block[1]}" if self.block else ""
        return f"{self.method} FP8, {self.weights}{block} weight scales, {self.activations} inputs"

    def ignored(self, layer: str) -> bool:
        """Whether the layer called `layer` (a checkpoint name, without `.weight`) stays full."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], layer):
                    return True
            elif layer == pattern or layer.endswith("." + pattern) or pattern in layer.split("."):
                return True
        return False

    def scale_rows(self, scale: torch.Tensor, name: str, n: int, k: int) -> torch.Tensor:
        """The checkpoint scale `scale` (tensor `name`) of an [n, k] weight as fp32 [n] (per
        channel or tensor) or [n, ceil(k / block cols)] (block-wise); ValueError naming the
        tensor when its shape does not fit."""
        s = scale.float()
        if self.weights == "channel":
            _expect(s.numel() == n and s.dim() <= 2, name, s, f"[{n}] or [{n}, 1]")
            return s.reshape(n).contiguous()
        if self.weights == "tensor":
            _expect(s.numel() == 1, name, s, "one value")
            return s.reshape(1).expand(n).contiguous()
        rows, cols = self.block
        want = (-(-n // rows), -(-k // cols))
        _expect(tuple(s.shape) == want, name, s, f"{list(want)} for {rows}x{cols} blocks")
        return s.repeat_interleave(rows, dim=0)[:n].contiguous()

    @property
    def block_k(self) -> int:
        return self.block[1] if self.block else 0


def _expect(ok: bool, name: str, t: torch.Tensor, want: str) -> None:
    if not ok:
        raise ValueError(f"checkpoint tensor {name}: shape {list(t.shape)}, expected {want}")


def read_fp8_checkpoint(config: dict) -> FP8Checkpoint | None:
    """The FP8 layout a config.json (as a dict) declares; None for a full-precision one."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError("quantization_config: expected an object")
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "fp8":
        return _block_fp8(q)
    raise ValueError(
        f"quantization_config.quant_method: {method!r} is not supported "
        "(supported: compressed-tensors float-quantized, fp8)"
    )


def _field(ok: bool, path: str, value, want: str) -> None:
    if not ok:
        raise ValueError(f"quantization_config.{path}: {value!r} is not supported ({want})")


def _compressed_tensors(q: dict) -> FP8Checkpoint:
    groups = q.get("config_groups")
    _field(isinstance(groups, dict) and bool(groups), "config_groups", groups, "one group")
    schemes = {}
    for gname, group in groups.items():
        path = f"config_groups.{gname}"
        fmt = group.get("format") or q.get("format")
        _field(fmt == "float-quantized", f"{path}.format", fmt, "float-quantized")
        _field(
            "Linear" in group.get("targets", []), f"{path}.targets", group.get("targets"), "Linear"
        )
        schemes[gname] = _ct_scheme(group, path)
    distinct = set(schemes.values())
    _field(len(distinct) == 1, "config_groups", sorted(schemes), "one scheme for all layers")
    weights, block, activations = distinct.pop()
    if q.get("kv_cache_scheme"):
        log.warning(
            "quantization_config.kv_cache_scheme is not used: tandem's KV dtype is --kv-dtype "
            "(fp8_e4m3 computes its own per-token scales)"
        )
    return FP8Checkpoint(
        "compressed-tensors", weights, block, activations, "weight_scale", _ignore(q, "ignore")
    )


def _ct_scheme(group: dict, path: str) -> tuple[str, tuple[int, int] | None, str]:
    w = group.get("weights") or {}
    _field(w.get("num_bits") == 8, f"{path}.weights.num_bits", w.get("num_bits"), "8")
    _field(w.get("type") == "float", f"{path}.weights.type", w.get("type"), "float")
    strategy = w.get("strategy")
    _field(
        strategy in WEIGHT_STRATEGIES,
        f"{path}.weights.strategy",
        strategy,
        "channel, tensor or block",
    )
    _field(w.get("symmetric", True), f"{path}.weights.symmetric", w.get("symmetric"), "true")
    _field(not w.get("dynamic", False), f"{path}.weights.dynamic", w.get("dynamic"), "false")
    block = None
    if strategy == "block":
        block = _block_size(w.get("block_structure"), f"{path}.weights.block_structure")
    a = group.get("input_activations")
    if a is None:
        return strategy, block, "none"
    apath = f"{path}.input_activations"
    _field(a.get("num_bits") == 8, f"{apath}.num_bits", a.get("num_bits"), "8")
    _field(a.get("type") == "float", f"{apath}.type", a.get("type"), "float")
    kind = (a.get("strategy"), bool(a.get("dynamic")))
    allowed = {("token", True): "dynamic", ("tensor", False): "static"}
    if block is not None:
        allowed[("group", True)] = "dynamic"
        size = a.get("group_size")
        if kind == ("group", True):
            _field(
                size == block[1], f"{apath}.group_size", size, f"{block[1]}, the block's columns"
            )
    _field(
        kind in allowed,
        f"{apath}.strategy",
        f"{kind[0]} (dynamic={kind[1]})",
        "dynamic token, static tensor, or dynamic group with block weights",
    )
    return strategy, block, allowed[kind]


def _block_fp8(q: dict) -> FP8Checkpoint:
    fmt = q.get("fmt", "e4m3")
    _field(fmt == "e4m3", "fmt", fmt, "e4m3")
    scheme = q.get("activation_scheme", "dynamic")
    _field(scheme in ("dynamic", "static"), "activation_scheme", scheme, "dynamic or static")
    size = q.get("weight_block_size")
    ignore = _ignore(q, "modules_to_not_convert") + _ignore(q, "ignored_layers")
    if size is None:
        return FP8Checkpoint("fp8", "tensor", None, scheme, "weight_scale", ignore)
    _field(scheme == "dynamic", "activation_scheme", scheme, "dynamic with weight_block_size")
    block = _block_size(size, "weight_block_size")
    return FP8Checkpoint("fp8", "block", block, "dynamic", "weight_scale_inv", ignore)


def _block_size(value, path: str) -> tuple[int, int]:
    ok = (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    )
    _field(ok, path, value, "two positive integers [rows, cols], e.g. [128, 128]")
    return int(value[0]), int(value[1])


def _ignore(q: dict, key: str) -> tuple[str, ...]:
    value = q.get(key) or []
    _field(isinstance(value, list) and all(isinstance(v, str) for v in value), key, value, "names")
    return tuple(value)
