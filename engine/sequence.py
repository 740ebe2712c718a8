"""A request inside the engine.

States: WAITING (queued, no KV) -> RUNNING (has blocks; prefilling in chunks, then decoding)
-> FINISHED. Preemption sends RUNNING back to WAITING with its blocks freed; it is recomputed
from its tokens (prompt + output so far) on readmission. Two states serve the split pools:
PREFILLED (prefill-only engine: first token sampled, blocks kept for the hand-off until
`release`) and REMOTE_KV (decode engine: admitted by the scheduler, blocks allocated, KV
arriving from a peer, until `commit_remote` -> RUNNING, `recompute_remote` -> WAITING as a
local prefill, or `abort`). A `kv_from_peer` sequence waits in WAITING like any other until the
scheduler admits it.

A request with `sampling.n > 1` is one sequence until its prompt is computed; at its first
sample the engine forks it into n choices (`forks`, choice 1..n-1, made at admission) that
share the prompt's full KV blocks by reference count (engine/llm_engine.py `_fork`). Choice i's
key in the engine is `choice_key(request_id, i)`; every output names the request and the choice.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams


def choice_key(request_id: str, choice: int) -> str:
    """The engine's key of one choice of a request (choice 0 is the request id itself)."""
    return request_id if choice == 0 else f"{request_id}#{choice}"


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
    # The request this sequence answers (its key differs for choices > 0) and which choice.
    group_id: str = ""
    choice: int = 0
    # Choices 1..n-1, waiting to fork from this one when its prompt is done.
    forks: list[Sequence] = field(default_factory=list)
    choices: list[Sequence] = field(default_factory=list)  # every choice, set by pop_finished
    # Per prompt position: None for the first, else (logprob, rank, top [(id, lp)]); filled
    # while the prompt is computed when `sampling.prompt_logprobs` is set.
    prompt_logprobs: list | None = None
    output_logprobs: list = field(default_factory=list)  # when sampling.logprobs is set
    cumulative_logprob: float = 0.0
    grammar: object | None = None  # engine.structured matcher when sampling.structured

    def __post_init__(self) -> None:
        if not self.group_id:
            self.group_id = self.request_id
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.sampling.seed is not None:
            # Choices of one seeded request draw from seed, seed+1, ...: reproducible, distinct.
            seed = (self.sampling.seed + self.choice) % 2**64
            self.generator = torch.Generator().manual_seed(seed)

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
