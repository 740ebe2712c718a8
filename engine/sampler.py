"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeds.

Greedy rows are one argmax over the batch. Sampled rows draw with the request's own
generator when it has a seed (so a seeded request is reproducible whatever batch it lands
in) and with the engine's generator otherwise.
"""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> list[int]:
    """logits: [batch, vocab] float32 (on any device). Returns one token id per row."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            out.append(greedy[row])
            continue
        x = _filter(logits[row].float().cpu() / p.temperature, p.top_k, p.top_p)
        probs = x.softmax(-1)
        out.append(int(torch.multinomial(probs, 1, generator=gen or default_generator)))
    return out
