"""Token sampling: logits processors, structured-output masks, greedy / temperature / top-k /
top-p / min-p, per-request seeds, and log-probabilities.

Order, as vLLM's: log-probabilities are taken from the model's raw logits (fp32, before any
processing: what transformers' log-softmax gives), then the logits processors (min_tokens,
logit_bias, penalties; engine/logits_processors.py) and the grammar mask change the logits the
choice is made from; greedy rows take the argmax of those, sampled rows divide by the
temperature and filter by min-p, top-k and top-p. Sampled rows draw with the request's own
generator when it has a seed (so a seeded request is reproducible whatever batch it lands in)
and with the engine's generator otherwise. Rows that ask for none of this cost one argmax.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from engine.logits_processors import apply_logits_processors, min_p_mask
from engine.scheduler import Sequence


def _filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    logits = min_p_mask(logits, min_p)
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


def _most_likely(x: torch.Tensor, fallback: int) -> int:
    finite = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)
    best = int(finite.argmax())
    return best if finite[best] > float("-inf") else fallback


def skip_draw(generator: torch.Generator, vocab_size: int) -> None:
    """Advance `generator` exactly as one sampled token does (one multinomial over the
    vocabulary, as `sample` draws): a request continued elsewhere after a token drawn on
    another worker keeps the stream of draws a single worker would have made."""
    torch.multinomial(torch.ones(vocab_size), 1, generator=generator)


def token_logprobs(logprobs_row: torch.Tensor, token: int, k: int) -> tuple:
    """(logprob of `token`, its rank (1 = most likely), [(id, logprob)] of the top k)."""
    lp = logprobs_row[token]
    rank = int((logprobs_row > lp).sum()) + 1
    top = []
    if k > 0:
        values, ids = torch.topk(logprobs_row, k)
        top = [[int(i), float(v)] for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return (float(lp), rank, top)


def sample(
    logits: torch.Tensor,
    seqs: list[Sequence],
    default_generator: torch.Generator,
    eos_token_ids: Seq[int] = (),
) -> tuple[list[int], list[tuple | None]]:
    """logits: [batch, vocab] float32 (on any device), row i for seqs[i]; modified in place.
    Returns one token id per row and, per row, its logprobs entry (None unless asked)."""
    want = [i for i, s in enumerate(seqs) if s.sampling.logprobs is not None]
    raw = logits[want].float().log_softmax(-1).cpu() if want else None
    apply_logits_processors(logits, seqs, eos_token_ids)
    matchers = [s.grammar for s in seqs]
    if any(m is not None for m in matchers):
        from engine.structured import apply_masks  # llguidance: only for structured requests

        apply_masks(logits, matchers)
    greedy = logits.argmax(dim=-1).tolist()
    tokens = []
    for row, seq in enumerate(seqs):
        p = seq.sampling
        if p.greedy:
            tokens.append(greedy[row])
            continue
        x = _filter(logits[row].float().cpu() / p.temperature, p.top_k, p.top_p, p.min_p)
        try:  # the row is on the CPU, where a NaN / inf distribution raises (no extra scan)
            token = torch.multinomial(
                x.softmax(-1), 1, generator=seq.generator or default_generator
            )
        except RuntimeError:
            # Extreme settings (a penalty of 1e-300, ...) overflow the row: take its most
            # likely token rather than fail the whole step, and every request in it.
            tokens.append(_most_likely(x, greedy[row]))
            continue
        tokens.append(int(token))
    entries: list[tuple | None] = [None] * len(seqs)
    for j, row in enumerate(want):
        entries[row] = token_logprobs(raw[j], tokens[row], seqs[row].sampling.logprobs)
    return tokens, entries
