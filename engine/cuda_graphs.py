"""Decode steps as CUDA graphs, captured once per batch-size bucket and replayed.

A decode step of a small model is a few hundred kernel launches whose host-side cost is
larger than their GPU time; replaying a captured graph launches them all at once. As in vLLM
and SGLang, one graph is captured per bucket of batch sizes (1, 2, 4, 8, then every 8 up to
`max_num_seqs`) into one shared memory pool, largest first; a step of n decodes replays the
smallest bucket >= n with its inputs copied into the graph's static buffers and the rows past n
padded (token 0, slot -1: the cache write skips it; context length 0: attention returns 0).
Only decode-only steps qualify whose longest context is at most `MAX_GRAPH_CONTEXT` (the
attention grid of a graph is sized for that bound, as vLLM's `max_seq_len_to_capture`);
prefill chunks, mixed steps, longer contexts and batches above the largest bucket run eagerly.
The attention backend must be capturable (`graph_safe`).

`StaticDecodeBatch` (the buffers and the padding) is separate from the capture, so the same
padded path runs eagerly on a CPU in the tests.
"""

from __future__ import annotations

import gc

import torch

from engine.model_runner import AttentionMetadata, forward_context

MAX_GRAPH_CONTEXT = 8192


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class StaticDecodeBatch:
    """Fixed-address inputs for a decode step of up to `max_batch` sequences."""

    def __init__(self, max_batch: int, max_context: int, block_size: int, device):
        i64 = dict(dtype=torch.int64, device=device)
        self.max_context = max_context
        self.ids = torch.zeros(max_batch, **i64)
        self.positions = torch.zeros(max_batch, **i64)
        self.slots = torch.full((max_batch,), -1, **i64)
        self.lens = torch.zeros(max_batch, **i64)
        self.tables = torch.zeros(max_batch, -(-max_context // block_size), **i64)

    def fill(self, input_ids, positions, meta: AttentionMetadata, bucket: int) -> None:
        n, width = input_ids.shape[0], meta.block_tables.shape[1]
        self.ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.lens[:n].copy_(meta.decode_context_lens)
        self.tables[:n, :width].copy_(meta.block_tables)
        if bucket > n:
            self.ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            self.slots[n:bucket].fill_(-1)
            self.lens[n:bucket].zero_()

    def metadata(self, bucket: int) -> AttentionMetadata:
        """Metadata over the first `bucket` rows. Its host-side lists say every row may hold
        `max_context` keys: the attention grid is sized for the longest context a graph
        serves, so one capture serves every step up to it."""
        return AttentionMetadata(
            slot_mapping=self.slots[:bucket],
            query_start=list(range(bucket + 1)),
            num_computed=[self.max_context - 1] * bucket,
            context_lens=[self.max_context] * bucket,
            block_tables=self.tables[:bucket],
            decode_idx=torch.arange(bucket, device=self.ids.device),
            prefill_idx=[],
            decode_context_lens=self.lens[:bucket],
        )


def decode_only(meta: AttentionMetadata) -> bool:
    return not meta.prefill_idx and meta.decode_idx.numel() > 0


class DecodeGraphs:
    """Captured decode forwards of `model`, one per bucket; `run` replays one or returns None
    when the step does not qualify (then the caller runs the model eagerly)."""

    def __init__(self, model, cache, backend, max_num_seqs: int, max_model_len: int):
        max_context = min(max_model_len, MAX_GRAPH_CONTEXT)
        if not getattr(backend, "graph_safe", False):
            raise ValueError(f"the {backend.name} attention backend cannot be captured")
        self.model, self.cache, self.backend = model, cache, backend
        self.sizes = capture_sizes(max_num_seqs)
        device = cache.device
        self.batch = StaticDecodeBatch(self.sizes[-1], max_context, cache.spec.block_size, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.replays = 0  # steps served by a graph (tests assert the path was taken)
        self.padded_runs = 0  # steps through the static buffers (replayed or not)

    def _forward(self, bucket: int) -> torch.Tensor:
        b = self.batch
        with forward_context(b.metadata(bucket)):
            return self.model(b.ids[:bucket], b.positions[:bucket], self.cache, self.backend)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (the pool is sized by the first capture).

        The garbage collector is held off while capturing: a collection that frees pinned host
        memory (an earlier engine's host KV tier) makes the host allocator query its events,
        which a capturing stream forbids; the capture then fails (seen on an H100)."""
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            self._capture_all()
        finally:
            if enabled:
                gc.enable()

    def _capture_all(self) -> None:
        for bucket in reversed(self.sizes):
            self.batch.slots[:bucket].fill_(-1)  # all padding: capture writes nothing
            self.batch.lens[:bucket].zero_()
            self._forward(bucket)  # warm-up: Triton compiles and autotunes outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA work of other threads (another engine in this process) must
            # neither invalidate this capture nor be captured into it.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.outputs[bucket] = self._forward(bucket)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

    def bucket_for(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def run(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor | None:
        """The step's hidden states, or None when it must run eagerly. A bucket that was not
        captured (on a CPU, in the tests) runs the same padded inputs without a graph."""
        if not decode_only(meta) or max(meta.context_lens) > self.batch.max_context:
            return None
        n = input_ids.shape[0]
        bucket = self.bucket_for(n)
        if bucket is None:
            return None
        self.batch.fill(input_ids, positions, meta, bucket)
        self.padded_runs += 1
        graph = self.graphs.get(bucket)
        if graph is None:
            return self._forward(bucket)[:n]
        graph.replay()
        self.replays += 1
        return self.outputs[bucket][:n]
