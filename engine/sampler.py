"""Token sampling: logits processors, structured-output masks, greedy / temperature / top-k /
top-p / min-p, per-request seeds, and log-probabilities.

Order, as vLLM's: log-probabilities are taken from the model's raw logits (fp32, before any
processing: what transformers' log-softmax gives), then the logits processors (allowed_token_ids,
bad words, min_tokens, logit_bias, penalties; below) and the grammar mask change the logits the
choice is made from; greedy rows take the argmax of those, sampled rows divide by the temperature
and filter by min-p, top-k and top-p. Sampled rows draw with the request's own generator when it
has a seed (so a seeded request is reproducible whatever batch it lands in) and with the engine's
generator otherwise. Rows that ask for none of this cost one argmax.

Logits processors (allowed_token_ids, bad words, min_tokens, logit_bias, repetition/frequency/
presence penalties, min_p): semantics and order are vLLM v1's sampler: on the fp32 logits,
allowed_token_ids sets every other logit to -inf, then each bad word masks its last token where
the output (never the prompt) ends with the rest of it, then min_tokens masks the stop tokens,
then logit_bias adds its biases, then the penalties (repetition over prompt and output tokens,
frequency and presence over output tokens only); temperature comes after all of these, and min_p
after temperature (`min_p_mask`, called by the sampler on the scaled logits). Token ids at or past
the logits' width are skipped by every processor: refusing them is the router's job (it knows the
tokenizer's vocabulary), and one request's bad id must not fail the batch it shares.

`apply_logits_processors` works in place and only on rows whose request asks for processing, so
a batch where nobody does costs one pass over its SamplingParams. Every processor touches only
the logits it changes, for all processed rows at once (flat indices `row * vocab + token`):
vLLM's whole-vocabulary penalty tensors (`where(seen, p, 1)`, `counts * f`) leave every other
logit as it was (x / 1, x * 1, x - 0), so skipping those gives the same floats for O(tokens)
work instead of several passes over [rows, vocab] (tens of ms on a CPU at a 128k vocabulary).
allowed_token_ids is the exception: it changes nearly every logit of its row, so it rewrites
that row (O(vocab), one row at a time).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from engine.scheduler import Sequence


def apply_logits_processors(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Seq[int]
) -> None:
    """Modify `logits` ([batch, vocab], fp32; row i is seqs[i]) in place."""
    rows = [i for i, s in enumerate(seqs) if s.sampling.needs_processing]
    if not rows:
        return
    if logits.dim() != 2 or logits.shape[0] != len(seqs):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(seqs)} sequences")
    vocab = logits.shape[1]
    _allowed_tokens(logits, seqs, [i for i in rows if seqs[i].sampling.allowed_token_ids], vocab)
    _bad_words(logits, seqs, [i for i in rows if seqs[i].sampling.bad_words_token_ids], vocab)
    _min_tokens(logits, seqs, rows, tuple(eos_token_ids), vocab)
    _logit_bias(logits, seqs, rows, vocab)
    _repetition_penalty(logits, seqs, [i for i in rows if seqs[i].sampling.repetition_penalty != 1])
    _output_penalties(logits, seqs, [i for i in rows if _has_output_penalty(seqs[i])])


def min_p_mask(logits_row_scaled: torch.Tensor, min_p: float) -> torch.Tensor:
    """Logits with every token less likely than `min_p` times the likeliest set to -inf.

    Takes the temperature-scaled logits (a row, or a batch along the last dim), as vLLM does:
    the threshold is relative to the distribution actually sampled from. Returns a new tensor.
    """
    if min_p <= 0.0:
        return logits_row_scaled
    probs = logits_row_scaled.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return logits_row_scaled.masked_fill(probs < threshold, float("-inf"))


def _has_output_penalty(seq: Sequence) -> bool:
    return bool(seq.sampling.frequency_penalty or seq.sampling.presence_penalty)


def _allowed_tokens(
    logits: torch.Tensor, seqs: list[Sequence], rows: list[int], vocab: int
) -> None:
    """Every logit of the row but the allowed ones -inf (their values kept, as vLLM's mask)."""
    for i in rows:
        seq = seqs[i]
        ids = seq.allowed_ids
        if ids is None or ids.device != logits.device:
            # Built once per request (the list may be as long as the vocabulary), filtered as
            # a tensor, not per id in Python.
            ids = torch.tensor(seq.sampling.allowed_token_ids, dtype=torch.int64)
            ids = seq.allowed_ids = ids[ids < vocab].to(logits.device)
        kept = logits[i, ids]
        logits[i] = float("-inf")
        logits[i, ids] = kept


def _bad_words(logits: torch.Tensor, seqs: list[Sequence], rows: list[int], vocab: int) -> None:
    """A word's last token -inf where the output ends with the rest of the word (vLLM v1).

    Matched against the output only: a word spanning the prompt / output boundary is not
    banned (vLLM's `past_tokens_ids` is the output). A one-token word is banned at every step.
    """
    r_idx: list[int] = []
    t_idx: list[int] = []
    for i in rows:
        seq = seqs[i]
        tokens, n_out = seq.token_ids, seq.num_output_tokens
        for word in seq.sampling.bad_words_token_ids:
            k = len(word) - 1  # the prefix that must end the output
            # k <= n_out: the tail compared lies within the output (never the prompt).
            if k > n_out or word[-1] >= vocab:
                continue
            if k == 0 or tuple(tokens[len(tokens) - k :]) == word[:-1]:
                r_idx.append(i)
                t_idx.append(word[-1])
    if r_idx:
        logits[_index(r_idx, logits), _index(t_idx, logits)] = float("-inf")


def _min_tokens(
    logits: torch.Tensor,
    seqs: list[Sequence],
    rows: list[int],
    eos: tuple[int, ...],
    vocab: int,
) -> None:
    # One indexed write for the whole batch: (row, token) pairs gathered in Python first.
    r_idx: list[int] = []
    t_idx: list[int] = []
    for i in rows:
        seq = seqs[i]
        sp = seq.sampling
        if seq.num_output_tokens >= sp.min_tokens:
            continue
        stops = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stops.update(eos)
        ids = [t for t in stops if t < vocab]
        r_idx += [i] * len(ids)
        t_idx += ids
    if r_idx:
        logits[_index(r_idx, logits), _index(t_idx, logits)] = float("-inf")


def _logit_bias(logits: torch.Tensor, seqs: list[Sequence], rows: list[int], vocab: int) -> None:
    r_idx: list[int] = []
    t_idx: list[int] = []
    biases: list[float] = []
    for i in rows:
        # A dict as in vLLM (OpenAI sends a JSON object): a repeated id keeps its last bias.
        # Ids past the logits are the router's to refuse; here they are skipped, not an error.
        bias = {t: b for t, b in seqs[i].sampling.logit_bias if t < vocab}
        r_idx += [i] * len(bias)
        t_idx += bias
        biases += bias.values()
    if r_idx:
        r, t = _index(r_idx, logits), _index(t_idx, logits)
        logits[r, t] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)


def _repetition_penalty(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """Every token in the prompt or the output: x > 0 -> x / p, else x * p (HF, vLLM)."""
    if not rows:
        return
    flat, vocab = _flat(logits)
    parts = []
    for i in rows:
        seq = seqs[i]
        parts += [_tokens(seq.prompt_token_ids, vocab, i), _tokens(seq.output_token_ids, vocab, i)]
    # Repeats stay in: each copy computes the same value from the same old logit, so whichever
    # write lands last is right, and deduplicating would cost a sort.
    idx = torch.cat(parts).to(logits.device)
    penalty = _per_row(logits, [seqs[i].sampling.repetition_penalty for i in rows], rows)
    p = penalty[idx // vocab]
    x = flat[idx]
    flat[idx] = torch.where(x > 0, x / p, x * p)
    _write_back(logits, flat)


def _output_penalties(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """Every output token: x -= f * count, then x -= q (OpenAI; vLLM's two roundings)."""
    if not rows:
        return
    flat, vocab = _flat(logits)
    parts = [_tokens(seqs[i].output_token_ids, vocab, i) for i in rows]
    idx, counts = torch.unique(torch.cat(parts), return_counts=True)
    idx, counts = idx.to(logits.device), counts.to(device=logits.device, dtype=logits.dtype)
    row = idx // vocab
    freq = _per_row(logits, [seqs[i].sampling.frequency_penalty for i in rows], rows)
    pres = _per_row(logits, [seqs[i].sampling.presence_penalty for i in rows], rows)
    x = flat[idx]
    x -= freq[row] * counts
    x -= pres[row]
    flat[idx] = x
    _write_back(logits, flat)


def _tokens(ids: list[int], vocab: int, row: int) -> torch.Tensor:
    """Flat indices `row * vocab + token` of `ids`, built on the CPU from a tensor rather than
    per-token Python (a prompt can be many thousands long)."""
    t = torch.tensor(ids, dtype=torch.int64)
    return t[t < vocab] + row * vocab


def _flat(logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    # A view when contiguous (the runner's logits are), else a copy `_write_back` returns.
    return logits.reshape(-1), logits.shape[1]


def _write_back(logits: torch.Tensor, flat: torch.Tensor) -> None:
    if flat.data_ptr() != logits.data_ptr():
        logits.copy_(flat.view_as(logits))


def _per_row(logits: torch.Tensor, values: list[float], rows: list[int]) -> torch.Tensor:
    """A [batch] tensor holding values[k] at rows[k] (zeros elsewhere, never read)."""
    out = torch.zeros(logits.shape[0], dtype=logits.dtype)
    out[rows] = torch.tensor(values, dtype=logits.dtype)
    return out.to(logits.device)


def _index(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=like.device)


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


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax: the first maximum, a NaN counting as the maximum (torch's and
    numpy's rule alike). A CPU row goes through numpy: torch's CPU argmax over a 49k
    vocabulary took ~90-150 us a row on a 2-core AMD EPYC, numpy's ~14 us, and a batch-1
    decode step of a 135M model is ~13 ms (`benchmarks/cpu_decode.py`)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return logits.detach().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


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
    greedy = argmax_rows(logits)
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
