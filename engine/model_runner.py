"""Turns a step plan into tensors, runs the model once, and samples.

Prefill computes logits only for the last token of each sequence that samples this step
(a chunk that does not reach the end of its prompt samples nothing), except for a sequence that
asked for prompt log-probabilities: its chunk's every position goes through the head too (in
slices, so a long chunk never holds a [tokens, vocab] tensor at once). A sequence about to fork
into n choices has its last row repeated once per choice, each sampled on its own.

The step's attention metadata (`AttentionMetadata`, built by `prepare`) is visible to every
attention layer during that one forward pass: `forward_context(meta)` sets it and always resets
it (try/finally), so a failed step can never leak one batch's block tables into the next; the
backends read it with `get_forward_context()`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.kv_cache import KVCache
from engine.sampler import sample, token_logprobs
from engine.scheduler import ScheduledSeq, Sequence, StepPlan


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's KV goes
    query_start: list[int]  # [num_seqs + 1] offsets of each sequence's tokens in the batch
    num_computed: list[int]  # [num_seqs] tokens already in the cache before this step
    context_lens: list[int]  # [num_seqs] cache length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    decode_idx: torch.Tensor  # sequences with one new token, batched together
    prefill_idx: list[int]  # sequences with several new tokens, run one by one
    decode_context_lens: torch.Tensor  # context_lens of decode_idx sequences


# Thread-local: two engines in one process (tests, benchmarks) each run their own steps.
_LOCAL = threading.local()


@contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    _LOCAL.meta = meta
    try:
        yield meta
    finally:
        _LOCAL.meta = None


def get_forward_context() -> AttentionMetadata:
    meta = getattr(_LOCAL, "meta", None)
    if meta is None:
        raise RuntimeError("attention called outside forward_context()")
    return meta


_HEADER = 6  # tokens, sequences, table width, decode seqs, prefill seqs, block copies


def pack_step(plan: StepPlan, block_size: int, copies: list[int] = ()) -> torch.Tensor:
    """One step as one int64 CPU tensor: a header, the per-sequence lists (query starts,
    computed and context lengths, prefill indices, the block copies [src, dst, ...] a fork
    made), then slots, ids, positions, decode indices and context lengths, block tables.

    Rank 0 unpacks it (`unpack_step`: one host-to-device copy for the whole step, six
    separate ones cost ~0.1 ms on a GPU) and, under TP, broadcasts the same tensor to the
    other ranks, which unpack it the same way. Plain Python lists first, then one tensor: a
    decode step of 64 sequences would otherwise build a few hundred tiny tensors."""
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start, num_computed, context_lens, tables = [0], [], [], []
    decode_idx, prefill_idx = [], []
    for i, s in enumerate(plan.scheduled):
        seq, n = s.seq, s.num_new_tokens
        c = seq.num_computed_tokens
        table = seq.block_table
        if n == 1:
            ids.append(seq.token_ids[c])
            positions.append(c)
            slots.append(table[c // bs] * bs + c % bs)
            decode_idx.append(i)
        else:
            ids += seq.token_ids[c : c + n]
            positions += range(c, c + n)
            slots += [table[p // bs] * bs + p % bs for p in range(c, c + n)]
            prefill_idx.append(i)
        query_start.append(query_start[-1] + n)
        num_computed.append(c)
        context_lens.append(c + n)
        tables.append(table)
    width = max(len(t) for t in tables)
    flat = [len(ids), len(tables), width, len(decode_idx), len(prefill_idx), len(copies) // 2]
    flat += query_start + num_computed + context_lens + prefill_idx + list(copies)
    flat += slots + ids + positions + decode_idx + [context_lens[i] for i in decode_idx]
    for t in tables:
        flat += t
        flat += [0] * (width - len(t))
    return torch.tensor(flat, dtype=torch.int64)


def unpack_step(flat: torch.Tensor, device: torch.device):
    """(ids, positions, AttentionMetadata, block copies [(src, dst)]) from `pack_step`'s
    CPU tensor; the tensors are on `device`."""
    n, s, width, d, p, c = flat[:_HEADER].tolist()
    at = _HEADER + 3 * s + 1 + p + 2 * c
    lists = flat[_HEADER:at].tolist()
    qs, nc, cl = lists[: s + 1], lists[s + 1 : 2 * s + 1], lists[2 * s + 1 : 3 * s + 1]
    prefill_idx, copies = lists[3 * s + 1 : 3 * s + 1 + p], lists[3 * s + 1 + p :]
    rest = flat[at:].to(device)
    cuts = [0, n, 2 * n, 3 * n, 3 * n + d, 3 * n + 2 * d]
    part = [rest[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    meta = AttentionMetadata(
        slot_mapping=part[0],
        query_start=qs,
        num_computed=nc,
        context_lens=cl,
        block_tables=rest[cuts[-1] :].view(s, width),
        decode_idx=part[3],
        prefill_idx=prefill_idx,
        decode_context_lens=part[4],
    )
    return part[1], part[2], meta, list(zip(copies[::2], copies[1::2], strict=True))


PROMPT_LOGPROBS_SLICE = 256  # positions per head call when scoring a prompt


class ModelRunner:
    def __init__(
        self,
        model,
        cache: KVCache,
        backend,
        device: torch.device,
        seed: int,
        eos_token_ids: tuple[int, ...] = (),
    ):
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.cache = cache
        self.backend = backend
        self.device = device
        self.block_size = cache.spec.block_size
        self.generator = torch.Generator().manual_seed(seed)
        self.graphs = None  # engine.cuda_graphs.DecodeGraphs once captured

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids, positions, meta, _ = unpack_step(self.pack(plan), self.device)
        return ids, positions, meta

    def pack(self, plan: StepPlan, copies: list[int] = ()) -> torch.Tensor:
        """The step as one int64 tensor (`pack_step`); the TP runner sends the same one."""
        return pack_step(plan, self.block_size, copies)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> tuple[list[Sequence], list[int], list[tuple | None]]:
        """Run one step. Returns the sequences that sample (each sampling sequence, followed by
        its pending forks), their tokens, and their logprobs entries (None unless asked)."""
        input_ids, positions, meta = self.prepare(plan)
        hidden = None if self.graphs is None else self.graphs.run(input_ids, positions, meta)
        if hidden is None:
            with forward_context(meta):
                hidden = self.model(input_ids, positions, self.cache, self.backend)
        rows: list[int] = []
        samplers: list[Sequence] = []
        for i, s in enumerate(plan.scheduled):
            last = meta.query_start[i + 1]
            if s.seq.sampling.prompt_logprobs is not None:
                self._score_prompt(s, hidden[meta.query_start[i] : last])
            if s.samples:
                group = [s.seq, *s.seq.forks] if s.seq.forks else [s.seq]
                rows += [last - 1] * len(group)
                samplers += group
        if not rows:
            return [], [], []
        if len(rows) < hidden.shape[0] or len(rows) > len(plan.scheduled):
            hidden = hidden[torch.tensor(rows, device=self.device)]
        logits = self.model.compute_logits(hidden)
        tokens, entries = sample(logits, samplers, self.generator, self.eos_token_ids)
        return samplers, tokens, entries

    @torch.inference_mode()
    def launch_greedy(self, plan: StepPlan, feed: torch.Tensor | None) -> torch.Tensor:
        """A decode-only step's argmax tokens, left on the device (engine.decode_ahead): no
        host sync. An input id -(k + 1) is a token still on the device, row k of `feed`."""
        input_ids, positions, meta = self.prepare(plan)
        if feed is not None:
            fed = feed[(-input_ids - 1).clamp(min=0)]
            input_ids = torch.where(input_ids < 0, fed, input_ids)
        hidden = None if self.graphs is None else self.graphs.run(input_ids, positions, meta)
        if hidden is None:
            with forward_context(meta):
                hidden = self.model(input_ids, positions, self.cache, self.backend)
        # One row per sequence (decode rows only), as `execute` samples them: the same
        # logits, the same first-maximum argmax.
        return self.model.compute_logits(hidden).argmax(dim=-1)

    def _score_prompt(self, s: ScheduledSeq, hidden: torch.Tensor) -> None:
        """Append the prompt positions this chunk scores to `seq.prompt_logprobs`: position p+1
        is scored by the logits at p. Positions already scored (before a preemption) are not
        scored again."""
        seq, start = s.seq, s.seq.num_computed_tokens
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
        k = seq.sampling.prompt_logprobs
        end = min(start + s.num_new_tokens, seq.num_prompt_tokens - 1)  # last scoring position
        first = max(start, len(seq.prompt_logprobs) - 1)
        for lo in range(first, end, PROMPT_LOGPROBS_SLICE):
            hi = min(lo + PROMPT_LOGPROBS_SLICE, end)
            logits = self.model.compute_logits(hidden[lo - start : hi - start])
            logprobs = logits.float().log_softmax(-1).cpu()
            for p in range(lo, hi):
                target = seq.token_ids[p + 1]
                seq.prompt_logprobs.append(token_logprobs(logprobs[p - lo], target, k))
