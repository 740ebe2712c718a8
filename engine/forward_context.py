"""Per-step attention metadata, visible to every attention layer during one forward pass.

`forward_context(meta)` sets it and always resets it (try/finally), so a failed step can
never leak one batch's block tables into the next.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


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
