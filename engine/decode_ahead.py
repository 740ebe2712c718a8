"""Decode one step ahead: launch step N+1 before reading step N's tokens back.

A decode step on a GPU is a graph replay that takes milliseconds, and the host work around it
(schedule, pack, fill the graph's inputs, then read the tokens back and record them) leaves
the GPU idle for a fraction of a millisecond each step: at batch 32 on an H200, 0.86 ms of a
7.0 ms step (GPU run 7). As vLLM V1's async scheduling and SGLang's overlap scheduler do,
the engine then schedules step N+1 while step N runs, assuming every sequence goes on by one
token, and feeds step N's tokens to N+1 on the device; it reads N's tokens back (waiting on
N alone, not N+1) and records them while N+1 runs.

Only steps whose outcome needs nothing but the argmax are launched ahead: decode rows only,
each sequence greedy, with no logprobs, logits processors, grammar or pending forks, and no
tensor parallelism or host KV tier. A sequence's token not yet read back is a placeholder in
its `token_ids`, `-(row + 1)` of the launching step's token tensor, which the next step's
input ids resolve on the device. A sequence that turns out to have finished (EOS, a stop
token) at step N had a row in step N+1 as well: that row is dropped, and its KV write lands
in blocks already freed, before any later step can reuse them (one stream orders both).
A sequence whose token in flight is its last by length (max_tokens, the context) sits the
next step out and finishes when read back. Anything else (a request arriving, an abort, a
transfer landing, a prefill) first reads the step in flight back ("drains"), and the engine
runs its ordinary step. Outputs come one step later than without it; the tokens are the same
(tests/engine/test_decode_ahead.py: token-exact with and without, every block freed).

Prefix-cache commits wait for the read-back: a block is committed once the step that wrote
its last position has been waited on, so a peer pulling committed blocks never reads KV a
step in flight is still writing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.outputs import TokenOutput
from engine.roles import PREFILL
from engine.scheduler import SeqStatus, Sequence, StepPlan

MODES = ("auto", "on", "off")


def placeholder(row: int) -> int:
    """The token id a sequence holds for a token still on the device (row of its step)."""
    return -(row + 1)


@dataclass(slots=True)
class InFlight:
    """A step launched ahead: its sequences, where each one's placeholder sits, its tokens."""

    rows: list[tuple[Sequence, int]]
    tokens: torch.Tensor  # on the device
    host: torch.Tensor  # the same, copied back without blocking
    done: torch.cuda.Event | None  # recorded after the copy (None on a CPU: already there)


class DecodeAhead:
    """The engine's steps launched ahead (see the module docstring). `engine` is the
    LLMEngine; this object touches its scheduler, block manager and runner."""

    def __init__(self, engine, mode: str):
        if mode not in MODES:
            raise ValueError(f"decode_ahead must be one of {MODES}, got {mode!r}")
        self.engine = engine
        wanted = mode == "on" or (
            mode == "auto" and engine.device.type == "cuda" and engine.runner.graphs is not None
        )
        # A prefill worker's steps end in a hand-off, not in a next step to launch.
        self.enabled = (
            wanted
            and engine.tp is None
            and engine.host_cache is None
            and engine.config.role != PREFILL
        )
        self.inflight: InFlight | None = None
        self.stash: list[TokenOutput] = []  # read back by a drain, returned by the next step
        self.launched = 0  # steps launched ahead (tests assert the path was taken)
        self.drained = 0  # steps in flight read back before an ordinary step
        self._buffers: list[torch.Tensor] | None = None

    # -- when ------------------------------------------------------------------------------
    def _plain(self, seq: Sequence) -> bool:
        sp = seq.sampling
        return (
            sp.greedy
            and sp.logprobs is None
            and sp.prompt_logprobs is None
            and not sp.needs_processing
            and seq.grammar is None
            and not seq.forks
        )

    def _goes_on(self, seq: Sequence) -> bool:
        """Whether `seq` has room for another token after those it holds (placeholders too):
        one at a limit sits the next step out (`_sitting_out`), never computed past it."""
        eng = self.engine
        return (
            seq.num_output_tokens < seq.sampling.max_tokens and seq.num_tokens < eng.max_model_len
        )

    def may_launch(self, plan: StepPlan) -> bool:
        """Whether `plan` (already scheduled) may be launched ahead."""
        if not self.enabled or plan.preempted or plan.fetch or not plan.scheduled:
            return False
        rows = plan.scheduled
        return all(s.num_new_tokens == 1 and s.samples and self._plain(s.seq) for s in rows)

    def _sitting_out(self) -> list[Sequence] | None:
        """Whether the next step can be scheduled before the one in flight is read back, and
        if so which running sequences sit it out; None when it cannot. It can with no request
        waiting (admission), every running sequence plain with one token to compute, one at
        least going on, and a slot for each of those without preempting anyone. A sequence
        whose placeholder is its last token by length (max_tokens, the context) sits the step
        out and finishes when read back, rather than draining the batch for it."""
        sched, bm = self.engine.scheduler, self.engine.block_manager
        if sched.waiting:
            return None
        in_flight = {id(seq) for seq, _ in self.inflight.rows}
        ending, needed = [], 0
        for seq in sched.running:
            if not self._plain(seq) or seq.num_tokens - seq.num_computed_tokens != 1:
                return None
            if self._goes_on(seq):
                needed += bm.blocks_needed(seq.num_computed_tokens + 1) - len(seq.block_table)
            elif id(seq) in in_flight:
                ending.append(seq)
            else:
                return None  # only a read-back finishes a sequence sitting a step out
        if len(ending) == len(sched.running) or needed > bm.num_free_blocks:
            return None
        return ending

    def _schedule_next(self, ending: list[Sequence]) -> StepPlan:
        """The next step of the running sequences but `ending`."""
        sched = self.engine.scheduler
        if ending:
            gone = {id(seq) for seq in ending}
            sched.running = [seq for seq in sched.running if id(seq) not in gone]
        try:
            return sched.schedule()
        finally:
            sched.running += ending

    # -- the steps ------------------------------------------------------------------------
    def launch(self, plan: StepPlan, feed: torch.Tensor | None = None) -> None:
        """Run `plan` on the device without waiting for its tokens; the sequences move on by a
        placeholder each."""
        eng = self.engine
        tokens = eng.runner.launch_greedy(plan, feed)
        on_gpu = tokens.device.type == "cuda"
        host = self._host_buffer(tokens)
        host.copy_(tokens, non_blocking=on_gpu)
        done = None
        if on_gpu:
            done = torch.cuda.Event()
            done.record()
        rows = []
        for row, s in enumerate(plan.scheduled):
            seq = s.seq
            seq.num_computed_tokens += 1
            rows.append((seq, len(seq.token_ids)))
            seq.token_ids.append(placeholder(row))
        self.inflight = InFlight(rows, tokens, host, done)
        eng.num_steps += 1
        self.launched += 1

    def _host_buffer(self, tokens: torch.Tensor) -> torch.Tensor:
        """Where a step's tokens come back: two pinned buffers in turn (the step read back and
        the one launched after it), allocated once, not a pinned allocation per step."""
        if self._buffers is None:
            pinned = tokens.device.type == "cuda"
            size = self.engine.config.max_num_seqs
            self._buffers = [
                torch.empty(size, dtype=tokens.dtype, pin_memory=pinned) for _ in range(2)
            ]
        return self._buffers[self.launched % 2][: tokens.shape[0]]

    def advance(self) -> list[TokenOutput]:
        """The engine's step while one is in flight: launch the next and read this one back,
        or, when the next cannot go ahead, read it back and run an ordinary step."""
        prev = self.inflight
        ending = self._sitting_out()
        if ending is not None:
            plan = self._schedule_next(ending)
            if plan.preempted or not plan.scheduled:  # _sitting_out rules both out
                raise RuntimeError("decode-ahead scheduled a step it cannot launch ahead")
            self.launch(plan, prev.tokens)
            return self._read_back(prev)
        self.inflight = None
        self.drained += 1
        return self._read_back(prev) + self.engine.step_now()

    def drain(self) -> None:
        """Read the step in flight back now (its outputs wait for the next `step()`)."""
        if self.inflight is not None:
            prev, self.inflight = self.inflight, None
            self.stash += self._read_back(prev)

    def take_stash(self) -> list[TokenOutput]:
        out, self.stash = self.stash, []
        return out

    def _read_back(self, step: InFlight) -> list[TokenOutput]:
        if step.done is not None:
            step.done.synchronize()  # this step only: the one launched after it runs on
        tokens = step.host.tolist()
        eng, now = self.engine, time.perf_counter()
        outputs = []
        for (seq, pos), token in zip(step.rows, tokens, strict=True):
            if seq.status is not SeqStatus.RUNNING:
                continue  # finished (or dropped) while this step was in flight: its row is void
            # Every position before `pos` has its KV written and waited on (and its token
            # read back: `pos` itself gets its token from `_record`).
            seq.num_committed_blocks = eng.block_manager.commit(
                seq.block_table, seq.token_ids, pos, seq.num_committed_blocks,
                salt=seq.sampling.cache_salt,
            )  # fmt: skip
            out = eng._record(seq, token, None, now, pos=pos)
            if out.finish_reason is not None:
                del seq.token_ids[pos + 1 :]  # a placeholder of the step after: void
                eng._finish(seq, out.finish_reason)
            outputs.append(out)
        return outputs
