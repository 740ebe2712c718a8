"""A request inside the engine.

States: WAITING (queued, no KV) -> RUNNING (has blocks; prefilling in chunks, then decoding)
-> FINISHED. Preemption sends RUNNING back to WAITING with its blocks freed; it is recomputed
from its tokens (prompt + output so far) on readmission. Two states serve the split pools:
PREFILLED (prefill-only engine: first token sampled, blocks kept for the hand-off until
`release`) and REMOTE_KV (decode engine: admitted by the scheduler, blocks allocated, KV
arriving from a peer, until `commit_remote` -> RUNNING, `recompute_remote` -> WAITING as a
local prefill, or `abort`). A `kv_from_peer` sequence waits in WAITING like any other until the
scheduler admits it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREFILLED = "prefilled"
    REMOTE_KV = "remote_kv"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_committed_blocks: int = 0  # blocks registered with the prefix cache
    num_cached_tokens: int = 0  # prefix-cache hit tokens at (last) admission
    num_preemptions: int = 0
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    generator: torch.Generator | None = None
    # Its prompt KV comes from a prefill peer (decode role) instead of being computed here.
    kv_from_peer: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED
