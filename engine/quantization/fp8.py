"""FP8 (e4m3) weights and activations: the tensor math, nothing model-specific.

Weights: e4m3 with fp32 scales, either one per output channel (`scale` [N], what tandem
writes when it quantizes a full checkpoint and what compressed-tensors' FP8_DYNAMIC ships) or
one per (output row, block of `block_k` input columns) (`scale` [N, ceil(K / block_k)], the
block-wise checkpoints' [128, 128] blocks expanded along the rows so fused projections whose
parts do not align to 128 rows keep exact scales).

Activations (W8A8): quantized on the fly, one scale per token (per token and K block for
block-wise weights, as DeepSeek's recipe does), or one static per-tensor scale from the
checkpoint. The product runs on `torch._scaled_mm`, FP8 tensor cores on Hopper/Ada; the CPU
runs it too, which keeps the path testable here. Weight-only: the weights are dequantized
into the activation dtype and multiplied there (no FP8 GEMM needed).

Rounding to e4m3 is round-to-nearest-even with saturation at +-448 (`FP8_MAX`): values are
divided by their scale, clamped, then cast.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# Floors a scale so that an all-zero row or token quantizes to zeros instead of NaN.
_MIN_SCALE = 1e-12


class FP8Tokens:
    """Activations already quantized for a W8A8 GEMM, one scale per token: what a fused norm
    or SiLU kernel hands the projection after it (engine.kernels.triton_fused), so the bf16
    row is never written. `dtype` is the activation dtype the GEMM's output takes."""

    __slots__ = ("q", "scale", "dtype")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.q, self.scale, self.dtype = q, scale, dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale (broadcast) saturated to +-FP8_MAX and rounded to e4m3."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_fp8_weight(
    w: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3 [N, K], scale fp32 [N]) per output channel: w ~= q * scale[:, None]. `amax`
    [N]: the whole rows' largest |w| when `w` holds only some columns (a row-parallel shard)."""
    amax = w.float().abs().amax(dim=1) if amax is None else amax
    scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)
    return to_fp8(w, scale[:, None]).contiguous(), scale.contiguous()


def quantize_fp8_tokens(
    x: torch.Tensor, block_k: int = 0, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization of x [M, K]: (q e4m3 [M, K], scale fp32 [M, G]) with one
    scale per token (G = 1) or, with `block_k`, per token and block of `block_k` columns.
    `amax` [M, 1] (per token only): the whole tokens' largest |x| when x holds some columns."""
    m, k = x.shape
    xf = x.float()
    if not block_k:
        amax = xf.abs().amax(dim=1, keepdim=True) if amax is None else amax
        scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)
        return to_fp8(xf, scale), scale
    groups = -(-k // block_k)
    pad = groups * block_k - k
    padded = torch.nn.functional.pad(xf, (0, pad)) if pad else xf
    amax = padded.view(m, groups, block_k).abs().amax(dim=2)
    scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)
    expanded = scale.repeat_interleave(block_k, dim=1)[:, :k]
    return to_fp8(xf, expanded), scale


def expand_block_scale(scale: torch.Tensor, block_k: int, k: int) -> torch.Tensor:
    """A weight scale ([N] or [N, ceil(K/block_k)]) broadcast to the weight's [N, K]."""
    if scale.dim() == 1:
        return scale[:, None].expand(-1, k)
    return scale.repeat_interleave(block_k, dim=1)[:, :k]


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block_k: int = 0) -> torch.Tensor:
    """q * scale as a fresh fp32 [N, K] tensor on q's device."""
    w = torch.empty(q.shape, dtype=torch.float32, device=q.device).copy_(q)
    return w.mul_(expand_block_scale(scale, block_k, q.shape[1]))


def fp8_linear(
    x: torch.Tensor | FP8Tokens,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    block_k: int = 0,
    input_scale: torch.Tensor | None = None,
    quantize_tokens=None,
) -> torch.Tensor:
    """W8A8: x [M, K] quantized to e4m3 (dynamic per token, or the static `input_scale`)
    times the e4m3 weight q [N, K], scaled back, plus bias; returns x.dtype [M, N].
    `quantize_tokens`: a faster equivalent of `quantize_fp8_tokens` (the GPU's one-pass
    kernel). On CUDA without a bias the GEMM writes x.dtype itself (its epilogue scales in
    fp32 and rounds once, as the fp32 output's cast would) instead of an fp32 [M, N] copy.
    `x` may come quantized already (`FP8Tokens`, per-token scales only)."""
    dtype = x.dtype
    if block_k:  # FP8Tokens carry per-token scales only: never given to a block-wise layer
        y = _block_linear(x, q, scale, block_k)
    else:
        xq, xs = _quantized_input(x, input_scale, quantize_tokens)
        direct = xq.is_cuda and bias is None
        # _scaled_mm wants the second operand column-major: q.t() is, without a copy.
        y = torch._scaled_mm(
            xq, q.t(), scale_a=xs, scale_b=scale.view(1, -1),
            out_dtype=dtype if direct else torch.float32,
        )  # fmt: skip
        if direct:
            return y
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def _quantized_input(x, input_scale, quantize_tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 activations, fp32 scales [M, 1]) for a per-channel W8A8 GEMM: as given
    (`FP8Tokens`), by the checkpoint's static scale, or quantized per token now."""
    if isinstance(x, FP8Tokens):
        return x.q, x.scale
    if input_scale is None:
        return (quantize_tokens or quantize_fp8_tokens)(x)
    xs = input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return to_fp8(x, xs), xs


def _block_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block_k: int):
    """Block-wise W8A8 in fp32: one scaled GEMM per K block (its activation scale per token,
    its weight scale per row), summed. K / block_k small GEMMs instead of one: correct on any
    device; a fused block-scaled kernel is the GPU's business."""
    xq, xs = quantize_fp8_tokens(x, block_k)
    k = x.shape[1]
    y = None
    for g, start in enumerate(range(0, k, block_k)):
        cols = slice(start, min(start + block_k, k))
        part = torch._scaled_mm(
            xq[:, cols].contiguous(),
            q[:, cols].t(),  # column-major with a row stride of K: no copy
            scale_a=xs[:, g : g + 1].contiguous(),
            scale_b=scale[:, g].contiguous().view(1, -1),
            out_dtype=torch.float32,
        )
        y = part if y is None else y.add_(part)
    return y


def fp8_weight_only_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    block_k: int = 0,
) -> torch.Tensor:
    """Weight-only: dequantize q, multiply in the activations' precision; returns x.dtype.

    On CPU the product runs in fp32 (widened x; bf16 GEMMs are emulated on CPUs without bf16
    instructions); elsewhere in x's dtype."""
    w = dequantize_fp8(q, scale, block_k)
    if x.device.type == "cpu":
        b = None if bias is None else bias.float()
        return torch.nn.functional.linear(x.float(), w, b).to(x.dtype)
    return torch.nn.functional.linear(x, w.to(x.dtype), bias)
