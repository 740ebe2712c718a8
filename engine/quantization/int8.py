"""Weight-only int8: the tensor math, nothing model-specific.

A decode step reads every weight once per step for a handful of tokens: it is bound by weight
bytes. Storing the projection weights as int8 with one fp32 scale per output channel halves
those bytes against bf16 (quarters them against fp32) at a small accuracy cost; activations,
norms and the embedding table stay in the model dtype. On CPU the head is int8 too, with one
scale per group of 32 weights of a row (`group`), as a GGUF Q8_0 file's: its logits pick the
tokens, and per-channel scales cost SmolLM2 60x bf16's KL on the head alone, groups of 32 none
(its GGUF head is Q8_0).

Scheme: symmetric, per output channel: scale[n] = max_k |w[n, k]| / 127, q = round(w / scale),
so every weight is within scale/2 of its original value. Applying the scheme to a model is
`engine.models.linear`'s job: `Linear.quantize_int8` swaps the weight for `quantize_int8`'s
pair in place and multiplies through the int8 kernels or `dequantize_int8`.
"""

from __future__ import annotations

import torch


def quantize_int8(
    w: torch.Tensor, amax: torch.Tensor | None = None, group: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scale fp32 [N]) with w ~= q * scale[:, None]. `amax` [N]: each row's
    largest |w| when `w` is only some of the row's columns (a row-parallel shard, whose scale
    must be the whole row's, engine.models.parallel); default: w's own. `group` > 0 (dividing
    K, a multiple of 16: the kernels' vector width): one scale per `group` consecutive weights
    of a row instead, scale [N, K / group] (as GGUF's Q8_0 with group 32)."""
    wf = w.float()
    if group:
        n, k = wf.shape
        if k % group or group % 16:
            raise ValueError(f"int8 group {group} must divide K={k} and be a multiple of 16")
        g = wf.view(n, k // group, group)
        scale = (g.abs().amax(dim=2) / 127.0).clamp(min=1e-12)
        q = torch.round(g / scale[:, :, None]).clamp(-127, 127).to(torch.int8).view(n, k)
        return q.contiguous(), scale.contiguous()
    amax = wf.abs().amax(dim=1) if amax is None else amax
    # The clamp keeps an all-zero row from dividing by zero (its q is then all zeros).
    scale = (amax / 127.0).clamp(min=1e-12)
    q = torch.round(wf / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale as a fresh fp32 [N, K] tensor on q's device (scale [N], or [N, K / group])."""
    # copy_ into an empty fp32 tensor then scale in place: one allocation, no int8->fp32 temp.
    w = torch.empty(q.shape, dtype=torch.float32, device=q.device).copy_(q)
    if scale.dim() == 2:
        n, k = q.shape
        w.view(n, scale.shape[1], -1).mul_(scale[:, :, None])
        return w
    return w.mul_(scale[:, None])
