"""Fused elementwise ops for the decoder layer on CUDA, in Triton: what engine.kernels.fused
does for CPUs, for the GPU.

Unfused, each layer launches about a dozen small kernels around its GEMMs (the RMSNorm's casts
and product, SiLU and the gate product), which on an
8B model at batch 1 cost more than attention (measured on an H100: ~0.8 ms of a 7.7 ms step).
Each op here is one kernel and keeps Hugging Face's rounding points (every intermediate HF
rounds to the activation dtype is rounded here too), with the same call signatures as the CPU
ops so the model uses either through `CausalLM.use_fused_ops`:

- `add_rms_norm(x, residual, weight, eps) -> (out, new_residual)`
- `silu_mul(gate_up) -> out`
- `quantize_fp8_tokens(x) -> (q, scale)`: FP8 e4m3 with one scale per token (amax / 448), the
  activation side of W8A8 in one pass instead of five (abs, amax, divide, clamp, cast);
- `add_rms_norm_fp8` / `silu_mul_fp8`: the norm and SiLU-and-multiply with that quantization
  fused in, for a W8A8 GEMM that reads only the FP8 row (engine.quantization.fp8.FP8Tokens).

They run on CPU tensors under TRITON_INTERPRET=1, which is how they are tested without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
MIN_SCALE = 1e-12


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, q_ptr, s_ptr, nr_ptr, s_x, s_r, H, eps,
    HAS_RES: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < H
    dt = x_ptr.dtype.element_ty  # x, residual and the output share the activation dtype
    x = tl.load(x_ptr + row * s_x + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + row * s_r + cols, mask=m, other=0.0).to(tl.float32)
        x = (x + r).to(dt).to(tl.float32)  # HF's residual add, in the activation dtype
        tl.store(nr_ptr + row * H + cols, x.to(dt), mask=m)
    var = tl.sum(x * x, 0) / H
    y = (x * (1.0 / tl.sqrt(var + eps))).to(dt).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    if QUANT:  # the bf16 value below, quantized as quantize_fp8_tokens would
        out = (w * y).to(dt).to(tl.float32)
        scale = tl.maximum(tl.max(tl.where(m, tl.abs(out), 0.0), 0) / 448.0, 1e-12)
        tl.store(s_ptr + row, scale)
        yq = tl.minimum(tl.maximum(out / scale, -448.0), 448.0)
        tl.store(q_ptr + row * H + cols, yq.to(q_ptr.dtype.element_ty), mask=m)
    else:
        tl.store(out_ptr + row * H + cols, (w * y).to(dt), mask=m)


def _launch_norm(x, residual, weight, eps, out, q, scale):
    """One _add_rms_norm_kernel launch: into `out`, or (`out` None) into `q` and `scale`."""
    rows, hidden = x.shape
    new_res = torch.empty_like(x) if residual is not None else x
    if rows:
        block = triton.next_power_of_2(hidden)
        _add_rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight,
            out if out is not None else x, q if q is not None else x,
            scale if scale is not None else x, new_res,
            x.stride(0), residual.stride(0) if residual is not None else 0, hidden, eps,
            HAS_RES=residual is not None, QUANT=out is None, BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
    return new_res


def add_rms_norm(x, residual, weight, eps):
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return out, _launch_norm(x, residual, weight, eps, out, None, None)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, s_g, INTER, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < INTER
    dt = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * s_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * s_g + INTER + cols, mask=m, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu, rounded as HF's
    tl.store(out_ptr + row * INTER + cols, (s * u).to(dt), mask=m)


def silu_mul(gate_up):
    rows, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), inter, BLOCK=block
        )
    return out


@triton.jit
def _quant_fp8_kernel(x_ptr, q_ptr, s_ptr, s_x, K, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    # Constant trip counts (CHUNKS = cdiv(K, BLOCK)): Triton's interpreter cannot loop to a
    # runtime bound.
    row = tl.program_id(0)
    amax = tl.zeros([BLOCK], tl.float32)
    for c in range(0, CHUNKS):
        cols = c * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * s_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0) / 448.0, 1e-12)
    tl.store(s_ptr + row, scale)
    for c in range(0, CHUNKS):  # the second read of the row comes from L2
        cols = c * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * s_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(q_ptr + row * K + cols, y.to(q_ptr.dtype.element_ty), mask=cols < K)


def quantize_fp8_tokens(x):
    """(q e4m3 [M, K], scale fp32 [M, 1]) as engine.quantization.fp8.quantize_fp8_tokens."""
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _quant_fp8_kernel[(rows,)](
            x, q, scale, x.stride(0), k, BLOCK=1024, CHUNKS=triton.cdiv(k, 1024)
        )
    return q, scale


# W8A8's activation side fused into the op that makes the activation (the norm before qkv and
# gate_up, SiLU-and-multiply before down): the FP8 row and its scale straight from registers,
# instead of the bf16 row written, read back and quantized by quantize_fp8_tokens. Each equals
# quantize_fp8_tokens(op(...)) exactly: the same values are rounded at the same points.


def add_rms_norm_fp8(x, residual, weight, eps):
    """(q e4m3 [M, H], scale fp32 [M, 1], new_residual): quantize_fp8_tokens of
    add_rms_norm's output, and its residual, in one kernel."""
    rows, hidden = x.shape
    q = torch.empty(rows, hidden, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    return q, scale, _launch_norm(x, residual, weight, eps, None, q, scale)


@triton.jit
def _silu_mul_fp8_kernel(
    gu_ptr, q_ptr, s_ptr, s_g, INTER, BLOCK: tl.constexpr, CHUNKS: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0)
    dt = gu_ptr.dtype.element_ty
    amax = tl.zeros([BLOCK], tl.float32)
    for c in range(0, CHUNKS):  # pass 1: the row's amax (as silu_mul would store it)
        cols = c * BLOCK + tl.arange(0, BLOCK)
        m = cols < INTER
        g = tl.load(gu_ptr + row * s_g + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * s_g + INTER + cols, mask=m, other=0.0).to(tl.float32)
        p = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u).to(dt).to(tl.float32)
        amax = tl.maximum(amax, tl.where(m, tl.abs(p), 0.0))
    scale = tl.maximum(tl.max(amax, 0) / 448.0, 1e-12)
    tl.store(s_ptr + row, scale)
    for c in range(0, CHUNKS):  # pass 2: the same products again (gate_up is in L2), scaled
        cols = c * BLOCK + tl.arange(0, BLOCK)
        m = cols < INTER
        g = tl.load(gu_ptr + row * s_g + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * s_g + INTER + cols, mask=m, other=0.0).to(tl.float32)
        p = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u).to(dt).to(tl.float32)
        yq = tl.minimum(tl.maximum(p / scale, -448.0), 448.0)
        tl.store(q_ptr + row * INTER + cols, yq.to(q_ptr.dtype.element_ty), mask=m)


@triton.jit
def _silu_mul_fp8_row_kernel(gu_ptr, q_ptr, s_ptr, s_g, INTER, BLOCK: tl.constexpr):
    # The whole row in registers: gate_up is read once (the chunked kernel reads it twice,
    # which made it 1.5x slower than the bf16 silu_mul on an H100's 8k-token prefill).
    row = tl.program_id(0)
    dt = gu_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    m = cols < INTER
    g = tl.load(gu_ptr + row * s_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * s_g + INTER + cols, mask=m, other=0.0).to(tl.float32)
    p = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u).to(dt).to(tl.float32)
    scale = tl.maximum(tl.max(tl.where(m, tl.abs(p), 0.0), 0) / 448.0, 1e-12)
    tl.store(s_ptr + row, scale)
    yq = tl.minimum(tl.maximum(p / scale, -448.0), 448.0)
    tl.store(q_ptr + row * INTER + cols, yq.to(q_ptr.dtype.element_ty), mask=m)


# Rows up to this many products are quantized in one pass (64 values a thread at 16 warps);
# longer rows take the chunked two-pass kernel.
SINGLE_PASS_MAX = 32768


def silu_mul_fp8(gate_up):
    """(q e4m3 [M, I], scale fp32 [M, 1]): quantize_fp8_tokens of silu_mul(gate_up)."""
    rows, two_i = gate_up.shape
    inter = two_i // 2
    q = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=gate_up.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=gate_up.device)
    if not rows:
        return q, scale
    block = triton.next_power_of_2(inter)
    if block <= SINGLE_PASS_MAX:
        warps = max(4, min(16, block // 1024))
        _silu_mul_fp8_row_kernel[(rows,)](
            gate_up, q, scale, gate_up.stride(0), inter, BLOCK=block, num_warps=warps
        )
    else:
        _silu_mul_fp8_kernel[(rows,)](
            gate_up, q, scale, gate_up.stride(0), inter, BLOCK=1024, CHUNKS=triton.cdiv(inter, 1024)
        )
    return q, scale


class TritonOps:
    """The fused ops as the model takes them (the CPU kernels' `CpuOps` interface)."""

    max_rows = None  # every step size: a GPU kernel has no per-call cost to amortise
    add_rms_norm = staticmethod(add_rms_norm)
    # No RoPE: a Triton RoPE written here (each product and the sum rounded to the dtype)
    # differed from HF's by a bf16 step in some elements on an H100 (fp32: by FMA contraction),
    # and bf16 greedy agreement with transformers fell (qwen3 125 -> 73 of 144 tokens); the
    # model keeps HF's own torch ops for it (benchmarks/README.md, GPU section).
    rope_ = None
    silu_mul = staticmethod(silu_mul)
    quantize_fp8_tokens = staticmethod(quantize_fp8_tokens)
    add_rms_norm_fp8 = staticmethod(add_rms_norm_fp8)
    silu_mul_fp8 = staticmethod(silu_mul_fp8)
