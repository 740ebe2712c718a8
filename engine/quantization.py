"""Weight-only int8 quantization for the decode pool.

A decode step reads every weight once per step for a handful of tokens: it is bound by weight
bytes. Storing the projection weights as int8 with one fp32 scale per output channel halves
those bytes against bf16 (quarters them against fp32) at a small accuracy cost; activations,
norms, the embedding table and the output head stay in the model dtype (the head is kept exact
because its logits pick the tokens).

Lifecycle: the model is built and loaded in its dtype as usual, then `quantize_model` replaces
each decoder-layer `Linear`'s weight by (int8 weight, scale) in place; `Linear.forward` then
multiplies through `engine.kernels`' int8 GEMV/GEMM on CPUs with AVX-512 (weights widened in
registers, fp32 accumulation, the scale applied to the sum) and otherwise through torch
(`F.linear(x, q.to(dtype)) * scale`, the weight-only scheme of gpt-fast).

Scheme: symmetric, per output channel: scale[n] = max_k |w[n, k]| / 127, q = round(w / scale),
so every weight is within scale/2 of its original value. FP8 W8A8 for the prefill pool
(DESIGN) needs `torch._scaled_mm` on a GPU and is not built.
"""

from __future__ import annotations

import torch

QUANTIZATIONS = ("none", "int8")


def validate(method: str | None) -> str:
    m = "none" if method is None else method
    if m not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    return m


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scale fp32 [N]) with w ~= q * scale[:, None]."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(wf / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def quantize_model(model, method: str | None) -> int:
    """Quantize the decoder layers' projections of `model` in place; returns how many."""
    if validate(method) == "none":
        return 0
    from engine.models.llama import Linear

    n = 0
    for layer in model.model.layers:
        for mod in layer.modules():
            if isinstance(mod, Linear):
                mod.quantize_int8()
                n += 1
    return n
