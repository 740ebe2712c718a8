"""Teacher-forced logits: the model's next-token logits at every position of a token sequence,
computed by the engine's own model, cache layout and attention backend.

Accuracy measurements (quantization against full precision, tests and
benchmarks/quant_accuracy.py) need the logits of every position, not only the last one the
serving path samples from. This runs one prefill of the whole sequence outside the scheduler,
on blocks taken from and given back to the engine's block manager, so it must not run while
the engine is stepping (call it on an idle engine, from the thread that owns it).
"""

from __future__ import annotations

import torch

from engine.forward_context import AttentionMetadata, forward_context


@torch.inference_mode()
def teacher_forced_logits(engine, token_ids: list[int]) -> torch.Tensor:
    """fp32 [len(token_ids), vocab]: row i is the distribution over token i + 1."""
    n = len(token_ids)
    if n < 1 or n > engine.max_model_len:
        raise ValueError(f"need 1..{engine.max_model_len} tokens, got {n}")
    bs = engine.config.block_size
    blocks = engine.block_manager.allocate_blocks(-(-n // bs))
    try:
        dev = engine.device
        i64 = torch.int64
        slots = [blocks[p // bs] * bs + p % bs for p in range(n)]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=i64, device=dev),
            query_start=[0, n],
            num_computed=[0],
            context_lens=[n],
            block_tables=torch.tensor([blocks], dtype=i64, device=dev),
            decode_idx=torch.zeros(0, dtype=i64, device=dev),
            prefill_idx=[0],
            decode_context_lens=torch.zeros(0, dtype=i64, device=dev),
        )
        ids = torch.tensor(token_ids, dtype=i64, device=dev)
        positions = torch.arange(n, dtype=i64, device=dev)
        with forward_context(meta):
            hidden = engine.model(ids, positions, engine.cache, engine.backend)
        return engine.model.compute_logits(hidden).float()
    finally:
        engine.block_manager.free(blocks)
