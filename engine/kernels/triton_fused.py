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
- `rope_(x, cos, sin, rot_heads)`: RoPE in place on the first `rot_heads` heads, one kernel for
  q and k instead of torch's five per layer (`engine.models.rope.rotate`); see `_rope_kernel`
  for how it stays bit-equal to HF's ops.

They run on CPU tensors under TRITON_INTERPRET=1, which is how they are tested without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
MIN_SCALE = 1e-12
# Triton's launch option that keeps a product and the sum after it two roundings instead of
# one FMA; its interpreter (numpy, no FMAs) takes no such option.
NO_FP_FUSION = {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}


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


@triton.jit
def _round_bf16(v):
    """fp32 -> the nearest bf16 (ties to even), as fp32: torch's rounding, done on the bits so
    that it is the same under Triton's interpreter (whose bf16 cast truncates) as on a GPU."""
    b = v.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _round_to(v, ROUND: tl.constexpr, dt: tl.constexpr):
    """v rounded to the activation dtype (ROUND 0: fp32, nothing; 1: bf16; 2: a cast)."""
    if ROUND == 1:
        return _round_bf16(v)
    elif ROUND == 2:
        return v.to(dt).to(tl.float32)
    else:
        return v


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, s_xt, s_xh, s_ct, heads,
    HALF: tl.constexpr, H_P: tl.constexpr, D_P: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    """One token's leading `heads` heads: HF's `x * cos + rotate_half(x) * sin` with cos/sin
    first rounded to the dtype (`cos.to(x.dtype)`), each product and the sum rounded as
    torch's separate ops round them. The products of two dtype values are exact in fp32, so
    only those roundings matter; launched with FMA contraction off (`rope_`), the fp32 case
    also keeps its product rounded before the sum, as torch's two kernels do (run 2's Triton
    RoPE lost bf16 agreement with transformers by contracting them)."""
    t = tl.program_id(0)
    dt = x_ptr.dtype.element_ty
    h = tl.arange(0, H_P)[:, None]
    i = tl.arange(0, D_P)[None, :]
    mask = (h < heads) & (i < HALF)
    c1 = _round_to(tl.load(cos_ptr + t * s_ct + i, mask=i < HALF, other=0.0), ROUND, dt)
    c2 = _round_to(tl.load(cos_ptr + t * s_ct + HALF + i, mask=i < HALF, other=0.0), ROUND, dt)
    s1 = _round_to(tl.load(sin_ptr + t * s_ct + i, mask=i < HALF, other=0.0), ROUND, dt)
    s2 = _round_to(tl.load(sin_ptr + t * s_ct + HALF + i, mask=i < HALF, other=0.0), ROUND, dt)
    p = x_ptr + t * s_xt + h * s_xh + i
    x1 = tl.load(p, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=mask, other=0.0).to(tl.float32)
    a = _round_to(_round_to(x1 * c1, ROUND, dt) - _round_to(x2 * s1, ROUND, dt), ROUND, dt)
    b = _round_to(_round_to(x2 * c2, ROUND, dt) + _round_to(x1 * s2, ROUND, dt), ROUND, dt)
    tl.store(p, a.to(dt), mask=mask)
    tl.store(p + HALF, b.to(dt), mask=mask)


def rope_(x, cos, sin, rot_heads):
    """In place on x's first `rot_heads` heads ([tokens, heads, head_dim], head_dim
    contiguous); cos/sin: the fp32 tables' rows [tokens, head_dim] (rounded here)."""
    tokens, _, dim = x.shape
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("rope_ needs head_dim contiguous and cos/sin laid out alike")
    if not tokens or not rot_heads:
        return x
    half = dim // 2
    block = triton.next_power_of_2(rot_heads) * triton.next_power_of_2(half)
    rounding = {torch.float32: 0, torch.bfloat16: 1}.get(x.dtype, 2)
    _rope_kernel[(tokens,)](
        x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), rot_heads,
        HALF=half, H_P=triton.next_power_of_2(rot_heads), D_P=triton.next_power_of_2(half),
        ROUND=rounding, num_warps=min(8, max(1, block // 512)), **NO_FP_FUSION,
    )  # fmt: skip
    return x


def rope_matches_torch(device) -> dict[str, bool]:
    """`rope_` against the model's torch RoPE (`engine.models.rope.rotate`, bit-equal to
    transformers') on `device`, bit for bit, per dtype: fp32 and bf16 on an 8B layer's head
    size, positions up to 64k. `gpu_ops` keeps the kernel only where every dtype agrees."""
    from engine.models.rope import rotate

    # Built on the CPU whatever the default device: the engine calls this while it loads a
    # model under `with torch.device("cuda")` (GPU run 7 found the check failing there).
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device=cpu).float() / 128))
    freqs = torch.randint(0, 65536, (9,), generator=g, device=cpu)[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(device), emb.sin().to(device)
    agree = {}
    for dt in (torch.float32, torch.bfloat16):
        x = (4 * torch.randn(9, 12, 128, generator=g, device=cpu)).to(device, dt)
        want = rotate(x[:, :10], cos.to(dt).unsqueeze(1), sin.to(dt).unsqueeze(1))
        got = rope_(x.clone(), cos, sin, 10)[:, :10]
        agree[str(dt).removeprefix("torch.")] = bool(torch.equal(got, want))
    return agree


class TritonOps:
    """The fused ops as the model takes them (the CPU kernels' `CpuOps` interface)."""

    max_rows = None  # every step size: a GPU kernel has no per-call cost to amortise
    add_rms_norm = staticmethod(add_rms_norm)
    rope_ = staticmethod(rope_)  # off (None) where rope_matches_torch fails: engine.kernels
    silu_mul = staticmethod(silu_mul)
    quantize_fp8_tokens = staticmethod(quantize_fp8_tokens)
    add_rms_norm_fp8 = staticmethod(add_rms_norm_fp8)
    silu_mul_fp8 = staticmethod(silu_mul_fp8)


class TritonOpsTorchRope(TritonOps):
    """The fused ops with RoPE left to torch: where the RoPE kernel disagreed with it."""

    rope_ = None
