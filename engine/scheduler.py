"""Requests inside the engine (`Sequence`, `SeqStatus`) and the token-budget scheduler that
moves them between states: continuous batching with chunked prefill, preemption, and requests
whose prompt KV arrives from a peer.

Each `schedule()` builds one step's plan under two limits, `max_num_batched_tokens` and
`max_num_seqs`. Running sequences go first, in arrival order, so decodes never starve behind
new prompts; each takes the tokens it still needs (1 when decoding, the rest of its prompt when
prefilling in chunks). When the KV cache cannot grow a running sequence, the youngest running
sequence is preempted (its blocks freed, to be recomputed later) until it can. Waiting
sequences are admitted afterwards, in arrival order, with whatever budget is left; one whose
prompt shares a block that a running sequence is computing now (not yet in the prefix cache)
waits a step, keeping its place, so the shared prefix is computed once (SGLang's in-batch
prefix caching). Every prefix match here, in-flight or cached, hashes a prompt under its
request's `cache_salt`, so only prompts of the same salt share blocks.

"Arrival order" is the fcfs policy's (vLLM's `--scheduling-policy`, `set_policy`). Under
"priority" the order is (`SamplingParams.priority`, arrival), lower first: the waiting queue is
kept in it (a preempted sequence goes back to its place, not to the head), running sequences
take their tokens in it, and the one preempted is the last in it (vLLM's rule).

One admission policy for one block pool: a request whose prompt KV comes from a prefill peer
(`Sequence.kv_from_peer`) waits in the same queue and is admitted by the same rules (a free
sequence slot, the blocks its prompt needs, nothing preempted this step). Admitted, it takes
blocks but no compute: it moves to REMOTE_KV (`fetching`) and is listed in `StepPlan.fetch`
so the engine's connector starts the transfer. It counts against `max_num_seqs` while its KV
is in flight, joins `running` when the KV landed (`add_running`), and from then on is an
ordinary sequence (preemptible, recomputed from its tokens). A failed transfer sends it back
to the head of the queue as a local prefill (`recompute`).

With a host KV tier (`Scheduler.host`, engine/kv_host_cache.py) an admission's prefix match
goes on in host memory after the device match; those blocks are copied into the fresh ones
before the step and count as cached tokens (`num_cached_tokens`: both tiers, once).

Sequence states: WAITING (queued, no KV) -> RUNNING (has blocks; prefilling in chunks, then
decoding) -> FINISHED. Preemption sends RUNNING back to WAITING with its blocks freed; it is
recomputed from its tokens (prompt + output so far) on readmission. Two states serve the split
pools: PREFILLED (prefill-only engine: first token sampled, blocks kept for the hand-off until
`release`) and REMOTE_KV (decode engine: admitted by the scheduler, blocks allocated, KV
arriving from a peer, until `commit_remote` -> RUNNING, `recompute_remote` -> WAITING as a local
prefill, or `abort`). A `kv_from_peer` sequence waits in WAITING like any other until the
scheduler admits it.

A request with `sampling.n > 1` is one sequence until its prompt is computed; at its first
sample the engine forks it into n choices (`forks`, choice 1..n-1, made at admission) that
share the prompt's full KV blocks by reference count (engine/llm_engine.py `_fork`). Choice i's
key in the engine is `choice_key(request_id, i)`; every output names the request and the choice.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.kv_cache import BlockManager
from engine.kv_events import prefix_block_hashes
from engine.protocol import SCHEDULING_POLICIES, SamplingParams


def _priority(seq: Sequence) -> tuple[int, float]:
    return seq.sampling.priority, seq.arrival_time


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
    # KV from a peer: leading prompt tokens this worker's prefix cache held at admission (not
    # read; not "cached" either: the peer computed or cached them for this request).
    num_reused_tokens: int = 0
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
    prompt_hashes: list[int] | None = None  # the scheduler's, for in-batch prefix sharing
    allowed_ids: torch.Tensor | None = None  # the sampler's allowed_token_ids, built once

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


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence: the step samples a token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class StepPlan:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]
    # Admitted this step with KV to receive from a peer (blocks allocated, no compute).
    fetch: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool,
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.by_priority = False  # set_policy
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.fetching: dict[str, Sequence] = {}  # REMOTE_KV: blocks held, KV in flight
        self.num_preemptions = 0
        self.host = None  # engine.kv_host_cache.HostKVCache when --kv-host-cache-gb is set
        self.remote_reuse = True  # --no-decode-kv-reuse: a remote prompt's blocks all READ
        self.num_prefix_waits = 0  # admissions put off a step for a prefix being computed

    def _allocate(self, seq: Sequence, token_ids: list[int], use_cache: bool, count: bool = True):
        """(block table, cached tokens, of which on the device) for `seq`'s `token_ids`, matched
        under its cache salt: the prefix match goes on in the host tier when there is one (its
        hits are copied back before the next step)."""
        salt = seq.sampling.cache_salt
        if self.host is not None:
            return self.host.allocate(token_ids, use_cache, count, salt)
        table, cached = self.bm.allocate(token_ids, use_cache, count, salt)
        return table, cached, cached

    def set_policy(self, policy: str) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}")
        self.by_priority = policy == "priority"

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self._queue(seq, at_head=False)

    def _queue(self, seq: Sequence, at_head: bool) -> None:
        """Into the waiting queue: at its end or head (fcfs), or at its place by priority."""
        if not self.by_priority:
            self.waiting.appendleft(seq) if at_head else self.waiting.append(seq)
            return
        key = _priority(seq)
        i = len(self.waiting)  # new work is usually the last: scan from the end
        while i > 0 and _priority(self.waiting[i - 1]) > key:
            i -= 1
        self.waiting.insert(i, seq)

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence whose KV is now in the cache (received from a peer). From here it
        is an ordinary sequence: preempted, it is recomputed here."""
        self.fetching.pop(seq.request_id, None)
        seq.kv_from_peer = False
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        """Something `schedule()` could act on (sequences whose KV is in flight are not)."""
        return bool(self.waiting or self.running)

    @property
    def num_active(self) -> int:
        """Sequences holding a batch slot: running, or admitted with their KV in flight."""
        return len(self.running) + len(self.fetching)

    @property
    def num_waiting_tokens(self) -> int:
        """Prompt tokens still to compute here (KV that will arrive from a peer is not)."""
        return sum(s.num_tokens - s.num_computed_tokens for s in self.waiting if not s.kv_from_peer)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finish or abort); the caller frees its blocks.
        A choice not yet forked from its request is in no queue."""
        if seq.status == SeqStatus.WAITING:
            if seq in self.waiting:
                self.waiting.remove(seq)
        elif seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.REMOTE_KV:
            self.fetching.pop(seq.request_id, None)

    def _reset(self, seq: Sequence) -> None:
        """Back to the head of the queue with no KV: it is recomputed from its tokens."""
        self.bm.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
        seq.status = SeqStatus.WAITING
        self._queue(seq, at_head=True)

    def _preempt(self, seq: Sequence) -> None:
        self._reset(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def recompute(self, seq: Sequence) -> None:
        """A peer's KV did not arrive (the transfer is over): prefill the prompt here."""
        self.fetching.pop(seq.request_id, None)
        seq.kv_from_peer = False
        self._reset(seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan([], [])
        budget = self._schedule_running(plan)
        # Admit new work only when nothing was preempted: otherwise we would thrash.
        if not plan.preempted:
            self._admit_waiting(plan, budget)
        return plan

    def _schedule_running(self, plan: StepPlan) -> int:
        """Give running sequences their tokens, preempting the youngest when blocks run out;
        returns the token budget left."""
        budget = self.max_num_batched_tokens
        # By priority, the first in priority order take their tokens first (and are kept).
        queue = sorted(self.running, key=_priority) if self.by_priority else list(self.running)
        kept: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0:
                kept.append(seq)
                continue
            while not self.bm.can_append(seq.block_table, seq.num_computed_tokens + n):
                # The last in the queue: the youngest, or by priority the last in that order
                # (the queue is sorted, and `seq`, taken from its head, is before every one).
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.bm.append_slots(seq.block_table, seq.num_computed_tokens + n)
                plan.scheduled.append(ScheduledSeq(seq, n))
                kept.append(seq)
                budget -= n
        self.running = kept
        return budget

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        if not self.waiting:  # the usual decode step: no set of in-flight blocks to build
            return
        inflight = self._in_flight_blocks()
        deferred: list[Sequence] = []
        try:
            while self.waiting and self.num_active < self.max_num_seqs:
                seq = self.waiting[0]
                if inflight and self._waits_for_prefix(seq, inflight):
                    deferred.append(self.waiting.popleft())
                    self.num_prefix_waits += 1
                    continue
                if seq.kv_from_peer:
                    if not self._admit_remote(seq, plan):
                        return
                    continue
                left = self._admit_local(seq, plan, budget)
                if left is None:
                    return
                budget = left
                if self.bm.enable_prefix_caching:
                    inflight.update(self._prompt_hashes(seq)[seq.num_committed_blocks :])
        finally:
            self.waiting.extendleft(reversed(deferred))  # at the head again, in order

    # -- in-batch prefix sharing (SGLang's): one computation of a prefix several prompts share
    def _prompt_hashes(self, seq: Sequence) -> list[int]:
        """The prompt's full-block hashes (computed once per sequence), salted like the cache's:
        a prompt waits only for a block it could hit, never another salt's."""
        if seq.prompt_hashes is None:
            bs = self.bm.block_size
            prompt = seq.prompt_token_ids
            salt = seq.sampling.cache_salt
            seq.prompt_hashes = prefix_block_hashes(prompt, bs, len(prompt) // bs, salt)
        return seq.prompt_hashes

    def _in_flight_blocks(self) -> set[int]:
        """Hashes of prompt blocks running sequences compute and have not committed yet."""
        if not self.bm.enable_prefix_caching:
            return set()
        out: set[int] = set()
        for seq in self.running:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                out.update(self._prompt_hashes(seq)[seq.num_committed_blocks :])
        return out

    def _waits_for_prefix(self, seq: Sequence, inflight: set[int]) -> bool:
        """Whether a prompt shares a block another sequence is computing right now: admitted
        a step later it finds that block (and the prefix before it) cached instead of
        computing it a second time. A prompt whose every position is computed (prompt
        logprobs) and KV from a peer are never held back."""
        if seq.kv_from_peer or seq.sampling.prompt_logprobs is not None:
            return False
        return any(h in inflight for h in self._prompt_hashes(seq))

    def _admit_remote(self, seq: Sequence, plan: StepPlan) -> bool:
        """Admit a sequence whose prompt KV comes from a peer; False when it does not fit."""
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        lookup = prompt if self.remote_reuse else None  # the same rule as _allocate
        if not self.bm.can_allocate(seq.num_prompt_tokens, lookup, seq.sampling.cache_salt):
            return False
        self.waiting.popleft()
        # Leading blocks this worker already caches are taken by reference (or copied back
        # from its host tier); the connector reads only the rest from the peer (decode-side
        # KV reuse).
        seq.block_table, seq.num_reused_tokens, _ = self._allocate(
            seq, prompt, self.remote_reuse, count=False
        )
        seq.status = SeqStatus.REMOTE_KV
        self.fetching[seq.request_id] = seq
        plan.fetch.append(seq)
        return True

    def _admit_local(self, seq: Sequence, plan: StepPlan, budget: int) -> int | None:
        """Admit a sequence to compute here; the budget left, or None when it does not fit."""
        lookup = seq.token_ids if seq.sampling.prompt_logprobs is None else None
        salt = seq.sampling.cache_salt
        if budget <= 0 or not self.bm.can_allocate(seq.num_tokens, lookup, salt):
            return None
        if not self.chunked:
            if seq.num_tokens - self.bm.cached_prefix_tokens(seq.token_ids, salt) > budget:
                return None
        self.waiting.popleft()
        # Prompt log-probabilities need every position computed: no cached prefix.
        use_cache = seq.sampling.prompt_logprobs is None
        seq.block_table, seq.num_cached_tokens, on_device = self._allocate(
            seq, seq.token_ids, use_cache
        )
        seq.num_computed_tokens = seq.num_cached_tokens
        # Promoted blocks are committed after this step, like the blocks it computes.
        seq.num_committed_blocks = on_device // self.bm.block_size
        seq.status = SeqStatus.RUNNING
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        plan.scheduled.append(ScheduledSeq(seq, n))
        self.running.append(seq)
        return budget - n
