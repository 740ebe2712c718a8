"""Teacher-forced logits: the model's next-token logits at every position of a token sequence,
computed by the engine's own model, cache layout and attention backend.

Accuracy measurements (quantization against full precision, tests and
benchmarks/quant_accuracy.py) need the logits of every position, not only the last one the
serving path samples from. This runs the sequence (one prefill, or chunks of a few rows)
outside the scheduler, on blocks taken from and given back to the engine's block manager, so
it must not run while the engine is stepping (call it on an idle engine, from the thread that
owns it).
"""

from __future__ import annotations

import torch

from engine.model_runner import forward_context
from engine.protocol import SamplingParams
from engine.scheduler import ScheduledSeq, Sequence, StepPlan


@torch.inference_mode()
def teacher_forced_logits(engine, token_ids: list[int], rows_per_step: int = 0) -> torch.Tensor:
    """fp32 [len(token_ids), vocab]: row i is the distribution over token i + 1.
    `rows_per_step` > 0 runs the sequence in chunks of that many tokens, each attending to the
    cached ones before it: with 1-3 the projections take the decode-row kernels (what
    "int8-w8a8" changes is only there); 0: one whole-prompt chunk."""
    n = len(token_ids)
    if n < 1 or n > engine.max_model_len:
        raise ValueError(f"need 1..{engine.max_model_len} tokens, got {n}")
    blocks = engine.block_manager.allocate_blocks(engine.block_manager.blocks_needed(n))
    try:
        # Chunks laid out by the runner exactly as serving steps would be.
        seq = Sequence("teacher-forcing", list(token_ids), SamplingParams(max_tokens=1))
        seq.block_table = blocks
        step = rows_per_step if rows_per_step > 0 else n
        out = []
        for start in range(0, n, step):
            seq.num_computed_tokens = start
            plan = StepPlan([ScheduledSeq(seq, min(step, n - start))], [])
            input_ids, positions, meta = engine.runner.prepare(plan)
            with forward_context(meta):
                hidden = engine.model(input_ids, positions, engine.cache, engine.backend)
            out.append(engine.model.compute_logits(hidden).float())
        return torch.cat(out)
    finally:
        engine.block_manager.free(blocks)
