"""Merge a request's TokenMessages into one in-order stream.

The first token comes from the prefill worker and the rest from the decode worker over
different sockets, so messages can arrive out of order or twice. `TokenReorderBuffer.push`
takes one message and returns the `Delivery`s that are now in order:

- index == next expected: delivered, then any buffered messages that became contiguous;
- index  > next expected: buffered; the gap's start time is kept so the caller can fail the
  request once the gap outlives its deadline (`gap_deadline`);
- entirely below next expected: a duplicate, dropped (`num_duplicates`); a message that
  overlaps the delivered prefix is trimmed to its new tokens;
- finish_reason "error" or "abort" ends the request at once, whatever its index (a failing
  worker does not know how far the stream got).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.protocol import TokenMessage

MAX_BUFFERED = 4096


@dataclass(slots=True)
class Delivery:
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    worker_id: str = ""
    prefill_worker_id: str = ""
    num_cached_tokens: int = 0
    logprobs: list | None = None  # one entry per token_ids entry, when asked
    prompt_logprobs: list | None = None


class ReorderError(RuntimeError):
    pass


class TokenReorderBuffer:
    def __init__(self) -> None:
        self.next_index = 0
        self.finished = False
        self.num_duplicates = 0
        self._pending: dict[int, TokenMessage] = {}
        self._gap_since: float | None = None

    @property
    def num_buffered(self) -> int:
        return len(self._pending)

    def gap_deadline(self, timeout_s: float) -> float | None:
        return None if self._gap_since is None else self._gap_since + timeout_s

    def push(self, msg: TokenMessage, now: float) -> list[Delivery]:
        if self.finished:
            return []
        if msg.finish_reason in ("error", "abort"):
            self.finished = True
            self._pending.clear()
            return [_delivery(msg, [], msg.finish_reason)]
        if msg.index > self.next_index:
            if msg.index in self._pending:
                self.num_duplicates += 1
            else:
                if len(self._pending) >= MAX_BUFFERED:
                    raise ReorderError(f"more than {MAX_BUFFERED} out-of-order token messages")
                self._pending[msg.index] = msg
                if self._gap_since is None:
                    self._gap_since = now
            return []
        out: list[Delivery] = []
        self._take(msg, out)
        while not self.finished and self._pending:
            ready = [i for i in self._pending if i <= self.next_index]
            if not ready:
                break
            for i in sorted(ready):
                if self.finished:
                    break
                self._take(self._pending.pop(i), out)
        if self.finished:
            self._pending.clear()
        # A gap that remains after progress is a new gap: its clock starts now.
        self._gap_since = None if not self._pending else (now if out else self._gap_since)
        return out

    def _take(self, msg: TokenMessage, out: list[Delivery]) -> None:
        end = msg.index + len(msg.token_ids)
        fresh = msg.token_ids[self.next_index - msg.index :]
        # An empty (or fully repeated) message still counts when it closes the stream exactly
        # where we are.
        if not fresh and not (msg.finish_reason and end == self.next_index):
            self.num_duplicates += 1
            return
        skip = self.next_index - msg.index
        self.next_index = max(self.next_index, end)
        if msg.finish_reason is not None:
            self.finished = True
        logprobs = msg.logprobs[skip:] if msg.logprobs is not None and skip >= 0 else None
        out.append(_delivery(msg, list(fresh), msg.finish_reason, logprobs))


def _delivery(
    msg: TokenMessage, token_ids: list[int], finish: str | None, logprobs: list | None = None
) -> Delivery:
    return Delivery(
        token_ids=token_ids,
        finish_reason=finish,
        error=msg.error,
        worker_id=msg.worker_id,
        prefill_worker_id=msg.prefill_worker_id,
        num_cached_tokens=msg.num_cached_tokens,
        logprobs=logprobs,
        prompt_logprobs=msg.prompt_logprobs,
    )
