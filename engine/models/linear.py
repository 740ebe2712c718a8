"""`Linear`: the projection layer of the models, with CPU GEMM routing and int8 weights.

On CPUs without bf16 instructions, torch's bf16 GEMM is oneDNN's emulation, several times
slower than fp32; `Linear` routes those GEMMs by row count to engine.kernels' bf16 kernels or
to oneDNN's fp32 GEMM on widened copies. After weight-only quantization (`quantize_linears`,
the scheme in `engine.quantization`) it multiplies int8 weights with per-channel scales.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine import quantization
from engine.kernels import CpuOps

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
    to the next path. `cpu_ops` None disables the routing (GPU, fp32, CPUs with native bf16).

    After `quantize_int8` the weight is int8 with per-channel scales and `_forward_int8` runs
    instead: the same kernels with int8 weights on CPU (`int8_ops`), dequantized fp32 GEMMs for
    prefill-sized inputs, torch's `F.linear(x, q.to(dtype)) * scale` elsewhere.
    """

    cpu_ops: CpuOps | None = None  # set when the bf16 routing is on
    widen_fallback = False  # routing on but no kernels: still avoid the emulated bf16 GEMM
    int8_ops: CpuOps | None = None  # set for int8 weights on a CPU with AVX-512
    # After quantize_int8: buffers qweight (int8 [N, K]) and wscale (fp32 [N]); weight is None.
    quantized = False

    def quantize_int8(self) -> None:
        """Replace the weight by int8 + per-channel scales (engine.quantization)."""
        q, scale = quantization.quantize_int8(self.weight.data)
        del self.weight
        self.register_buffer("qweight", q)
        self.register_buffer("wscale", scale)
        self.weight = None  # nn.Linear's attribute; the int8 buffers replace it
        self.quantized = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            return self._forward_int8(x)
        ops = self.cpu_ops
        if ops is None and not self.widen_fallback:
            return F.linear(x, self.weight, self.bias)
        m = x.shape[0] if x.dim() == 2 else -1
        if ops is not None and 0 < m <= TILED_MAX_ROWS:
            if m <= GEMV_MAX_ROWS and ops.gemv is not None:
                return ops.gemv(x, self.weight, None, self.bias)
            if ops.tiled_linear is not None:
                return ops.tiled_linear(x, self.weight, None, self.bias)
        bias = None if self.bias is None else widen(self.bias)
        return F.linear(widen(x), widen(self.weight), bias).to(x.dtype)

    def _forward_int8(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.int8_ops
        m = x.shape[0] if x.dim() == 2 else -1
        if ops is not None and 0 < m <= TILED_MAX_ROWS and x.dtype in KERNEL_DTYPES:
            op = ops.gemv if m <= GEMV_MAX_ROWS else ops.tiled_linear
            return op(x, self.qweight, self.wscale, self.bias)
        if x.device.type == "cpu" and x.dtype in KERNEL_DTYPES:
            # Prefill-sized on CPU: dequantize once per call and use oneDNN's fp32 GEMM.
            w = quantization.dequantize_int8(self.qweight, self.wscale)
            bias = None if self.bias is None else widen(self.bias)
            return F.linear(widen(x), w, bias).to(x.dtype)
        # GPU or other dtypes: int8 values are exact in any float dtype; scale the product.
        y = F.linear(x, self.qweight.to(x.dtype)) * self.wscale.to(x.dtype)
        return y if self.bias is None else y + self.bias


def quantize_linears(module: nn.Module, method: str | None) -> int:
    """Quantize every `Linear` inside `module` in place with `method` (engine.quantization's
    names; "none" or None does nothing); returns how many were quantized. The caller picks
    the module: the models pass their decoder layers so the head and embeddings stay exact."""
    if quantization.validate(method) == "none":
        return 0
    n = 0
    for mod in module.modules():
        if isinstance(mod, Linear):
            mod.quantize_int8()
            n += 1
    return n
