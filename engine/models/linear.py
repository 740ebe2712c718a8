"""`Linear`: the projection layer of the models, with CPU GEMM routing and quantized weights.

On CPUs without bf16 instructions, torch's bf16 GEMM is oneDNN's emulation, several times
slower than fp32; `Linear` routes those GEMMs by row count to engine.kernels' bf16 kernels or
to oneDNN's fp32 GEMM on widened copies. After quantization (`quantize_linears`, the schemes in
`engine.quantization`) it multiplies int8 weights (weight-only) or FP8 weights (W8A8 through
`torch._scaled_mm`, or weight-only).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine import quantization
from engine.kernels import CpuOps
from engine.quantization import fp8

# Row counts that pick the bf16 GEMM on CPUs without bf16 instructions (see Linear); measured
# on the project's 2-core box (`python benchmarks/cpu_kernels.py`).
GEMV_MAX_ROWS = 3  # up to here: bandwidth-bound GEMV, one pass over the weight
TILED_MAX_ROWS = 64  # up to here: the 4x4-tiled kernel; beyond it: oneDNN fp32 on widened copies
# Activation dtypes the linear kernels and the widened CPU paths take.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16_gemm() -> bool:
    """True when the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); unknown -> True."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return True


def q8_fits(qweight: torch.Tensor, wscale: torch.Tensor) -> bool:
    """Whether engine.kernels.linear_q8 takes this int8 weight: K in whole blocks of 32, and
    group scales (if any) in whole blocks too."""
    k = qweight.shape[1]
    return k % 32 == 0 and (wscale.dim() == 1 or (k // wscale.shape[1]) % 32 == 0)


def widen(t: torch.Tensor) -> torch.Tensor:
    """A CPU fp32 copy of `t`."""
    # copy_ into a fresh fp32 tensor: measured ~5x faster than t.float() for bf16 on CPU.
    return torch.empty(t.shape, dtype=torch.float32).copy_(t)


class Linear(nn.Linear):
    """nn.Linear that routes bf16 GEMMs around the slow paths of CPUs with no bf16 instructions.

    Without AVX512-BF16/AMX, torch's bf16 GEMM (oneDNN's emulation) runs several times slower
    than fp32. When enabled (`CausalLM.use_cpu_bf16_kernels`), by the number of rows:
    - up to GEMV_MAX_ROWS: `gemv` (engine.kernels.linear) streams the bf16 weight once;
    - up to TILED_MAX_ROWS: `tiled_linear`, the 4x4-tiled kernel (decode batches, small chunks);
    - beyond: x and the weight are widened to fp32 and multiplied by oneDNN's fp32 GEMM, which
      is faster than the tiled kernel once the widening is amortised over hundreds of rows.
    All compute what a bf16 GEMM with fp32 accumulation computes (bf16 products are exact in
    fp32), up to summation order, and round the result to bf16. A missing kernel falls through
    to the next path. `cpu_ops` None disables the routing (GPU, fp32). On CPUs with native
    bf16 (`gemv_only`) only the GEMV rows take the kernel: oneDNN's native bf16 GEMM is
    faster from 4 rows up, but at 1-3 rows (a decode step's) it reads the weight at ~0.8x the
    kernel's rate (`benchmarks/cpu_kernels.py`).

    After `quantize_int8` the weight is int8 with per-channel scales and `_forward_int8` runs
    instead: the same kernels with int8 weights on CPU (`int8_ops`), dequantized fp32 GEMMs for
    prefill-sized inputs, torch's `F.linear(x, q.to(dtype)) * scale` elsewhere. After
    `quantize_fp8` / `empty_fp8` the weight is FP8 e4m3 and `_forward_fp8` runs: W8A8 through
    `torch._scaled_mm` when `fp8_activations`, else weight-only (engine.quantization.fp8).
    """

    cpu_ops: CpuOps | None = None  # set when the bf16 routing is on
    widen_fallback = False  # routing on but no kernels: still avoid the emulated bf16 GEMM
    gemv_only = False  # native bf16 GEMM: only the GEMV rows leave torch (see `forward`)
    int8_ops: CpuOps | None = None  # set for int8 weights on a CPU with the kernels
    int8_q8 = False  # "int8-w8a8": decode rows through int8_ops.gemv_q8 (engine.kernels.linear_q8)
    # After quantization: buffers qweight (int8 or e4m3 [N, K]) and wscale (fp32 [N], or
    # [N, ceil(K / block_k)] for block-wise FP8); weight is None. scheme: None, "int8", "fp8".
    scheme: str | None = None
    fp8_activations = False  # FP8 only: W8A8 (True) or weight-only (False)
    token_quantizer = None  # FP8 W8A8 on CUDA: the one-pass Triton activation quantization
    block_k = 0  # FP8 only: the K block of block-wise scales; 0 = one scale per output channel
    # FP8 W8A8 with a checkpoint's static scale: buffer `input_scale` (None otherwise),
    # registered by `_replace_weight` (a class attribute would shadow the buffer).

    @property
    def quantized(self) -> bool:
        return self.scheme is not None

    def _replace_weight(self, scheme: str, q: torch.Tensor, scale: torch.Tensor) -> None:
        del self.weight
        self.register_buffer("qweight", q)
        self.register_buffer("wscale", scale)
        self.weight = None  # nn.Linear's attribute; the quantized buffers replace it
        self.register_buffer("input_scale", None)
        self.scheme = scheme

    def quantize_int8(self, group: int = 0) -> None:
        """Replace the weight by int8 + per-channel scales (engine.quantization), or one scale
        per `group` weights of a row (the CPU head)."""
        self._replace_weight("int8", *quantization.quantize_int8(self.weight.data, group=group))

    def quantize_fp8(self, activations: bool) -> None:
        """Replace the weight by FP8 e4m3 + per-channel scales; `activations`: W8A8."""
        self._replace_weight("fp8", *fp8.quantize_fp8_weight(self.weight.data))
        self.fp8_activations = activations

    def empty_fp8(self, activations: bool, block_k: int = 0, static_input: bool = False) -> None:
        """Replace the weight by empty FP8 buffers for a loader to fill: scales per output
        channel, or per row and block of `block_k` columns; `static_input` adds an
        `input_scale` (a checkpoint's per-tensor activation scale, -inf until loaded)."""
        n, k = self.weight.shape
        dev = self.weight.device
        q = torch.empty(n, k, dtype=fp8.FP8, device=dev)
        shape = (n, -(-k // block_k)) if block_k else (n,)
        self._replace_weight("fp8", q, torch.empty(shape, dtype=torch.float32, device=dev))
        self.fp8_activations, self.block_k = activations, block_k
        if static_input:
            self.register_buffer("input_scale", torch.full((), -torch.inf, device=dev))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme == "int8":
            return self._forward_int8(x)
        if self.scheme == "fp8":
            return self._forward_fp8(x)
        ops = self.cpu_ops
        if ops is None and not self.widen_fallback:
            return F.linear(x, self.weight, self.bias)
        m = x.shape[0] if x.dim() == 2 else -1
        if ops is not None and 0 < m <= GEMV_MAX_ROWS and ops.gemv is not None:
            return ops.gemv(x, self.weight, None, self.bias)
        if self.gemv_only:
            return F.linear(x, self.weight, self.bias)
        if ops is not None and 0 < m <= TILED_MAX_ROWS:
            if ops.tiled_linear is not None:
                return ops.tiled_linear(x, self.weight, None, self.bias)
        bias = None if self.bias is None else widen(self.bias)
        return F.linear(widen(x), widen(self.weight), bias).to(x.dtype)

    def _forward_int8(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.int8_ops
        m = x.shape[0] if x.dim() == 2 else -1
        if ops is not None and 0 < m <= TILED_MAX_ROWS and x.dtype in KERNEL_DTYPES:
            if self.int8_q8 and m <= GEMV_MAX_ROWS and q8_fits(self.qweight, self.wscale):
                return ops.gemv_q8(x, self.qweight, self.wscale, self.bias)
            op = ops.gemv if m <= GEMV_MAX_ROWS else ops.tiled_linear
            return op(x, self.qweight, self.wscale, self.bias)
        if x.device.type == "cpu" and x.dtype in KERNEL_DTYPES:
            # Prefill-sized on CPU: dequantize once per call and use oneDNN's fp32 GEMM.
            w = quantization.dequantize_int8(self.qweight, self.wscale)
            bias = None if self.bias is None else widen(self.bias)
            return F.linear(widen(x), w, bias).to(x.dtype)
        if self.wscale.dim() == 2:  # group scales: dequantize (not a decode path off CPU)
            w = quantization.dequantize_int8(self.qweight, self.wscale).to(x.dtype)
            return F.linear(x, w, self.bias)
        # GPU or other dtypes: int8 values are exact in any float dtype; scale the product.
        y = F.linear(x, self.qweight.to(x.dtype)) * self.wscale.to(x.dtype)
        return y if self.bias is None else y + self.bias

    @property
    def takes_fp8_tokens(self) -> bool:
        """W8A8 with dynamic per-token activation scales: the input may come quantized
        (`fp8.FP8Tokens`) from a fused norm or SiLU kernel."""
        return (
            self.scheme == "fp8" and bool(self.fp8_activations)
            and not self.block_k and self.input_scale is None
        )  # fmt: skip

    def _forward_fp8(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, fp8.FP8Tokens):
            return fp8.fp8_linear(x, self.qweight, self.wscale, self.bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.fp8_activations:
            y = fp8.fp8_linear(
                x2,
                self.qweight,
                self.wscale,
                self.bias,
                self.block_k,
                self.input_scale,
                quantize_tokens=self.token_quantizer,
            )
        else:
            y = fp8.fp8_weight_only_linear(x2, self.qweight, self.wscale, self.bias, self.block_k)
        return y.reshape(*shape[:-1], y.shape[-1])


def quantize_linears(module: nn.Module, method: str | None) -> int:
    """Quantize every full-precision `Linear` inside `module` in place with `method` (one of
    engine.quantization.RESOLVED; "none", "auto" or None does nothing); returns how many were
    quantized. The caller picks the module: the models pass their decoder layers so the head
    and embeddings stay exact. Layers already quantized (an FP8 checkpoint's) are left alone."""
    method = quantization.validate(method)
    if method in ("none", "auto"):
        return 0
    if method not in quantization.RESOLVED:
        raise ValueError(f"quantization {method!r} must be resolved first (engine.quantization)")
    n = 0
    for mod in module.modules():
        if isinstance(mod, Linear) and not mod.quantized:
            if method in quantization.INT8_LAYOUTS:
                mod.quantize_int8()
            else:
                mod.quantize_fp8(activations=method == "fp8")
            n += 1
    return n
