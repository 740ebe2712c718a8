"""Weight-only int8: the tensor math, nothing model-specific.

A decode step reads every weight once per step for a handful of tokens: it is bound by weight
bytes. Storing the projection weights as int8 with one fp32 scale per output channel halves
those bytes against bf16 (quarters them against fp32) at a small accuracy cost; activations,
norms, the embedding table and the output head stay in the model dtype (the head is kept exact
because its logits pick the tokens).

Scheme: symmetric, per output channel: scale[n] = max_k |w[n, k]| / 127, q = round(w / scale),
so every weight is within scale/2 of its original value. Applying the scheme to a model is
`engine.models.linear`'s job: `Linear.quantize_int8` swaps the weight for `quantize_int8`'s
pair in place and multiplies through the int8 kernels or `dequantize_int8`.
"""

from __future__ import annotations

import torch


def quantize_int8(
    w: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scale fp32 [N]) with w ~= q * scale[:, None]. `amax` [N]: each row's
    largest |w| when `w` is only some of the row's columns (a row-parallel shard, whose scale
    must be the whole row's, engine.models.parallel); default: w's own."""
    wf = w.float()
    amax = wf.abs().amax(dim=1) if amax is None else amax
    # The clamp keeps an all-zero row from dividing by zero (its q is then all zeros).
    scale = (amax / 127.0).clamp(min=1e-12)
    q = torch.round(wf / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale[:, None] as a fresh fp32 [N, K] tensor on q's device."""
    # copy_ into an empty fp32 tensor then scale in place: one allocation, no int8->fp32 temp.
    w = torch.empty(q.shape, dtype=torch.float32, device=q.device).copy_(q)
    return w.mul_(scale[:, None])
