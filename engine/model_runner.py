"""Turns a step plan into tensors, runs the model once, and samples.

Prefill computes logits only for the last token of each sequence that samples this step
(a chunk that does not reach the end of its prompt samples nothing).
"""

from __future__ import annotations

import torch

from engine.forward_context import AttentionMetadata, forward_context
from engine.kv_cache import KVCache
from engine.sampler import sample
from engine.scheduler import StepPlan


class ModelRunner:
    def __init__(self, model, cache: KVCache, backend, device: torch.device, seed: int):
        self.model = model
        self.cache = cache
        self.backend = backend
        self.device = device
        self.block_size = cache.spec.block_size
        self.generator = torch.Generator().manual_seed(seed)

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        # Plain Python lists, then one tensor each: a decode step of 64 sequences would
        # otherwise build a few hundred tiny tensors.
        bs = self.block_size
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
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        i64 = torch.int64
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=i64, device=dev),
            query_start=query_start,
            num_computed=num_computed,
            context_lens=context_lens,
            block_tables=torch.tensor(padded, dtype=i64, device=dev),
            decode_idx=torch.tensor(decode_idx, dtype=i64, device=dev),
            prefill_idx=prefill_idx,
            decode_context_lens=torch.tensor(
                [context_lens[i] for i in decode_idx], dtype=i64, device=dev
            ),
        )
        input_ids = torch.tensor(ids, dtype=i64, device=dev)
        return input_ids, torch.tensor(positions, dtype=i64, device=dev), meta

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[int]:
        """Run one step; return the sampled token of each sequence that samples, in order."""
        input_ids, positions, meta = self.prepare(plan)
        rows = [meta.query_start[i + 1] - 1 for i, s in enumerate(plan.scheduled) if s.samples]
        with forward_context(meta):
            hidden = self.model(input_ids, positions, self.cache, self.backend)
        if not rows:
            return []
        if len(rows) < hidden.shape[0]:  # a decode-only step samples every row: no gather
            hidden = hidden[torch.tensor(rows, device=self.device)]
        logits = self.model.compute_logits(hidden)
        samplers = [s.seq for s in plan.scheduled if s.samples]
        return sample(
            logits,
            [s.sampling for s in samplers],
            [s.generator for s in samplers],
            self.generator,
        )
