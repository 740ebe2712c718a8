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
        bs = self.block_size
        ids: list[int] = []
        pos_chunks, slot_chunks = [], []
        query_start, num_computed, context_lens, tables = [0], [], [], []
        decode_idx, prefill_idx = [], []
        for i, s in enumerate(plan.scheduled):
            seq, n = s.seq, s.num_new_tokens
            c = seq.num_computed_tokens
            ids += seq.token_ids[c : c + n]
            table = torch.tensor(seq.block_table, dtype=torch.int64)
            p = torch.arange(c, c + n, dtype=torch.int64)
            pos_chunks.append(p)
            slot_chunks.append(table[p // bs] * bs + p % bs)
            query_start.append(query_start[-1] + n)
            num_computed.append(c)
            context_lens.append(c + n)
            tables.append(seq.block_table)
            (decode_idx if n == 1 else prefill_idx).append(i)
        width = max(len(t) for t in tables)
        block_tables = torch.zeros(len(tables), width, dtype=torch.int64)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slot_chunks).to(dev),
            query_start=query_start,
            num_computed=num_computed,
            context_lens=context_lens,
            block_tables=block_tables.to(dev),
            decode_idx=torch.tensor(decode_idx, dtype=torch.int64, device=dev),
            prefill_idx=prefill_idx,
            decode_context_lens=torch.tensor(
                [context_lens[i] for i in decode_idx], dtype=torch.int64, device=dev
            ),
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        return input_ids, torch.cat(pos_chunks).to(dev), meta

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[int]:
        """Run one step; return the sampled token of each sequence that samples, in order."""
        input_ids, positions, meta = self.prepare(plan)
        rows = [meta.query_start[i + 1] - 1 for i, s in enumerate(plan.scheduled) if s.samples]
        with forward_context(meta):
            hidden = self.model(input_ids, positions, self.cache, self.backend)
        if not rows:
            return []
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        samplers = [s.seq for s in plan.scheduled if s.samples]
        return sample(
            logits,
            [s.sampling for s in samplers],
            [s.generator for s in samplers],
            self.generator,
        )
