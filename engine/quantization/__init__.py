"""Quantization of the projection weights: the names a pool can ask for, and what each means
on the device and checkpoint at hand. Torch only (a leaf), so configuration code can
`validate` a setting without loading model code.

Methods (what `EngineConfig.quantization` and `tandem serve --prefill-quantization /
--decode-quantization` take):

| name              | weights                       | activations into the GEMM         |
|-------------------|-------------------------------|-----------------------------------|
| `none`            | the model dtype               | the model dtype                   |
| `int8`            | int8, per-channel scales      | the model dtype (weight-only)     |
| `int8-w8a8`       | int8, per-channel scales      | CPU decode rows: int8 (see below) |
| `fp8`             | FP8 e4m3, per-channel scales  | FP8 e4m3, dynamic per-token scales|
| `fp8-weight-only` | FP8 e4m3, per-channel scales  | the model dtype (weight-only)     |

- `int8-w8a8`: `int8`'s weights; on a CPU with AVX2 the decode rows (1-3 a projection) are
  quantized too, per block of 32 values as llama.cpp's Q8_0 does, and multiplied in integers
  (engine.kernels.linear_q8: ~1.3x the int8 GEMV's rate, 1.7x on the group-quantized head).
  It changes the answers where `int8` does not; prefill rows (compute-bound) keep their
  activations. Elsewhere (GPU, no kernels) it is `int8`.
- `weight-only`: `fp8-weight-only` where the device has FP8 (CUDA 8.9+) or the checkpoint is
  FP8, else `int8` (the decode pool's choice in `tandem serve --quantized`).
- `auto` (the default): as the checkpoint: `none` for a full one; for an FP8 one `fp8`, or
  `fp8-weight-only` on a device without FP8 GEMMs.

The decoder layers' projections are quantized; embeddings, norms and the output head stay in
the model dtype (the head picks the tokens). A full checkpoint is quantized on load; an FP8
checkpoint (`engine.quantization.checkpoint`: compressed-tensors `float-quantized` and the
block-wise `quant_method: fp8`) keeps its own FP8 weights and scales.

Reading order: this file, `int8.py`, `fp8.py` (the tensor math), `checkpoint.py` (FP8
checkpoint configurations and their scales).
"""

from __future__ import annotations

import torch

from engine.quantization.int8 import dequantize_int8, quantize_int8

QUANTIZATIONS = ("auto", "none", "int8", "int8-w8a8", "fp8", "fp8-weight-only", "weight-only")
# What `resolve` returns: the layout the weights actually get.
RESOLVED = ("none", "int8", "int8-w8a8", "fp8", "fp8-weight-only")
INT8_LAYOUTS = ("int8", "int8-w8a8")  # int8 weights (the second: int8 decode activations)

__all__ = [
    "QUANTIZATIONS",
    "INT8_LAYOUTS",
    "RESOLVED",
    "dequantize_int8",
    "device_has_fp8_gemm",
    "quantize_int8",
    "resolve",
    "validate",
]


def validate(method: str | None) -> str:
    """The canonical name of a quantization setting (None means "auto"); ValueError otherwise."""
    m = "auto" if method is None else method
    if m not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    return m


def device_has_fp8_gemm(device: torch.device | str) -> bool:
    """Whether `torch._scaled_mm` multiplies FP8 on `device`: CUDA from compute capability 8.9
    (Ada, Hopper, Blackwell); the CPU runs it too (slowly: for correctness, not speed)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


def resolve(method: str | None, fp8_checkpoint: bool, device: torch.device | str) -> str:
    """The layout (one of RESOLVED) that `method` gives on `device` for a full
    (`fp8_checkpoint` False) or FP8 checkpoint; ValueError for a combination that cannot run."""
    m = validate(method)
    device = torch.device(device)
    fp8_gemm = device_has_fp8_gemm(device)
    fp8_native = device.type == "cuda" and fp8_gemm
    if fp8_checkpoint:
        if m == "auto":
            m = "fp8" if fp8_gemm else "fp8-weight-only"
        elif m == "weight-only":
            m = "fp8-weight-only"
        elif m in ("none", *INT8_LAYOUTS):
            raise ValueError(
                f"quantization {m!r} needs full-precision weights but the checkpoint is FP8: "
                "use auto, fp8 or fp8-weight-only (the checkpoint's FP8 weights are kept)"
            )
    elif m == "auto":
        m = "none"
    elif m == "weight-only":
        m = "fp8-weight-only" if fp8_native else "int8"
    if m == "fp8" and not fp8_gemm:
        raise ValueError(
            f"quantization 'fp8' (W8A8) needs FP8 GEMMs, which {device} lacks "
            "(CUDA compute capability 8.9+): use fp8-weight-only or int8"
        )
    return m
