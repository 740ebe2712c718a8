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

from engine.model_runner import forward_context
from engine.protocol import SamplingParams
from engine.scheduler import ScheduledSeq, Sequence, StepPlan


@torch.inference_mode()
def teacher_forced_logits(engine, token_ids: list[int]) -> torch.Tensor:
    """fp32 [len(token_ids), vocab]: row i is the distribution over token i + 1."""
    n = len(token_ids)
    if n < 1 or n > engine.max_model_len:
        raise ValueError(f"need 1..{engine.max_model_len} tokens, got {n}")
    blocks = engine.block_manager.allocate_blocks(engine.block_manager.blocks_needed(n))
    try:
        # One whole-prompt chunk, laid out by the runner exactly as a serving step would be.
        seq = Sequence("teacher-forcing", list(token_ids), SamplingParams(max_tokens=1))
        seq.block_table = blocks
        input_ids, positions, meta = engine.runner.prepare(StepPlan([ScheduledSeq(seq, n)], []))
        with forward_context(meta):
            hidden = engine.model(input_ids, positions, engine.cache, engine.backend)
        return engine.model.compute_logits(hidden).float()
    finally:
        engine.block_manager.free(blocks)
