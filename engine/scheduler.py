"""Token-budget scheduler: continuous batching with chunked prefill and preemption.

Each `schedule()` builds one step's plan under two limits, `max_num_batched_tokens` and
`max_num_seqs`. Running sequences go first, in arrival order, so decodes never starve behind
new prompts; each takes the tokens it still needs (1 when decoding, the rest of its prompt when
prefilling in chunks). When the KV cache cannot grow a running sequence, the youngest running
sequence is preempted (its blocks freed, to be recomputed later) until it can. Waiting
sequences are admitted afterwards with whatever budget is left, prefix-cache hits first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.sequence import SeqStatus, Sequence


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
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence whose KV is already in the cache (received from a peer)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting_tokens(self) -> int:
        return sum(s.num_tokens - s.num_computed_tokens for s in self.waiting)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finish or abort); the caller frees its blocks."""
        if seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> StepPlan:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        queue = list(self.running)
        kept: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0:
                kept.append(seq)
                continue
            while not self.bm.can_append(seq.block_table, seq.num_computed_tokens + n):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.bm.append_slots(seq.block_table, seq.num_computed_tokens + n)
                scheduled.append(ScheduledSeq(seq, n))
                kept.append(seq)
                budget -= n
        self.running = kept

        # Admit new work only when nothing was preempted: otherwise we would thrash.
        while (
            self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            if not self.bm.can_allocate(seq.num_tokens, seq.token_ids):
                break
            if not self.chunked:
                hits = len(self.bm._lookup(seq.token_ids)) * self.bm.block_size
                if seq.num_tokens - hits > budget:
                    break
            self.waiting.popleft()
            seq.block_table, seq.num_cached_tokens = self.bm.allocate(seq.token_ids)
            seq.num_computed_tokens = seq.num_cached_tokens
            seq.num_committed_blocks = seq.num_cached_tokens // self.bm.block_size
            seq.status = SeqStatus.RUNNING
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            scheduled.append(ScheduledSeq(seq, n))
            self.running.append(seq)
            budget -= n
        return StepPlan(scheduled, preempted)
