"""One request from dispatch to its last piece of text: `Generation`.

Lifecycle: route (decode worker, local or remote prefill; counted) -> register a token queue ->
send GenerateRequest or PrefillRequest -> wait for TokenMessages, failing the request when an
index gap outlives `token_gap_timeout_s` or the request outlives `request_timeout_s` -> put
them in index order per choice (`TokenReorderBuffer`; a request with n > 1 streams n choices,
each with its own reorder buffer and detokenizer) -> detokenize, apply stop strings and the
token limit -> yield `Piece`s until every choice has finished. One record per token batch from
the socket to the detokenizer: the worker's `TokenMessage` itself (trimmed when it overlaps
what was delivered), then the `Piece` carrying its text. Whatever way it ends before the
workers said they finished (stop string, error, timeout, or the caller closing the generator
because the client went away), AbortRequest goes to every worker involved.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from msgspec.structs import replace

from engine.protocol import (
    AbortRequest,
    GenerateRequest,
    PrefillRequest,
    PrefixSource,
    TokenMessage,
)
from router.config import RouterConfig
from router.dataplane import DataPlane, SendError
from router.detokenizer import IncrementalDetokenizer
from router.errors import APIError
from router.metrics import RouterMetrics
from router.openai_api import ParsedRequest
from router.responses import Placement
from router.routing import LOCAL, NoWorkersError, RoutePlan, WorkerPool
from router.signal_recorder import SignalRecorder

log = logging.getLogger(__name__)


def _prefix_source(plan: RoutePlan) -> PrefixSource | None:
    """Where the prefill worker may READ the prompt's leading blocks (router/routing.py)."""
    src = plan.prefix_source
    if src is None:
        return None
    return PrefixSource(src.worker_id, src.request_endpoint, plan.prefix_source_tokens)


@dataclass(slots=True)
class Piece:
    """Text of one choice that became ready for the client, with the tokens behind it (and
    their logprobs entries when asked; `prompt_logprobs` comes with the first piece)."""

    text: str
    num_tokens: int
    finish_reason: str | None = None
    choice: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    prompt_logprobs: list | None = None


# ------------------------------------------------------------------ in-order delivery

MAX_BUFFERED = 4096


class ReorderError(RuntimeError):
    pass


class TokenReorderBuffer:
    """Merges one choice's TokenMessages into one in-order stream.

    The first token comes from the prefill worker and the rest from the decode worker over
    different sockets, so messages can arrive out of order or twice. `push` takes one message
    and returns the messages that are now in order, each one the worker's own record (trimmed
    to its new tokens when it overlaps the delivered prefix):

    - index == next expected: delivered, then any buffered messages that became contiguous;
    - index  > next expected: buffered; the gap's start time is kept so the caller can fail the
      request once the gap outlives its deadline (`gap_deadline`);
    - entirely below next expected: a duplicate, dropped (`num_duplicates`);
    - finish_reason "error" or "abort" ends the request at once, whatever its index (a failing
      worker does not know how far the stream got), delivered without tokens.
    """

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

    def push(self, msg: TokenMessage, now: float) -> list[TokenMessage]:
        if self.finished:
            return []
        if msg.finish_reason in ("error", "abort"):
            self.finished = True
            self._pending.clear()
            return [replace(msg, token_ids=[], logprobs=None)]
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
        out: list[TokenMessage] = []
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

    def _take(self, msg: TokenMessage, out: list[TokenMessage]) -> None:
        skip = self.next_index - msg.index  # >= 0: tokens already delivered
        end = msg.index + len(msg.token_ids)
        # An empty (or fully repeated) message still counts when it closes the stream exactly
        # where we are.
        if end <= self.next_index and not (msg.finish_reason and end == self.next_index):
            self.num_duplicates += 1
            return
        if skip:  # overlaps the delivered prefix: keep only its new tokens
            logprobs = None if msg.logprobs is None else msg.logprobs[skip:]
            tokens = msg.token_ids[skip:]
            msg = replace(msg, index=self.next_index, token_ids=tokens, logprobs=logprobs)
        self.next_index = max(self.next_index, end)
        if msg.finish_reason is not None:
            self.finished = True
        out.append(msg)


class ChoiceState:
    """One choice's stream: in-order delivery, detokenization, its own stop and length."""

    def __init__(self, index: int, parsed: ParsedRequest, tokenizer: Any) -> None:
        self.index = index
        self.reorder = TokenReorderBuffer()
        self.detok = IncrementalDetokenizer(
            tokenizer, parsed.stop, parsed.include_stop_str, parsed.skip_special_tokens
        )
        self.num_tokens = 0
        self.done = False
        self.cumulative_logprob = 0.0


@dataclass(slots=True, frozen=True)
class GenerationContext:
    """What every Generation of one server shares."""

    config: RouterConfig
    pool: WorkerPool
    dataplane: DataPlane
    metrics: RouterMetrics
    tokenizer: Any
    # Runs a fire-and-forget coroutine (the abort) that the server awaits on stop().
    spawn: Callable[[Coroutine[Any, Any, None]], None]
    # The planner's window of this router's traffic (routes, first tokens, finishes).
    signals: SignalRecorder | None = None


class Generation:
    """Iterate `pieces()` once (under `contextlib.aclosing`, so an early exit aborts)."""

    def __init__(
        self, ctx: GenerationContext, parsed: ParsedRequest, rid: str, arrival: float
    ) -> None:
        self.ctx = ctx
        self.parsed = parsed
        self.rid = rid
        self.arrival = arrival  # time.monotonic(), the clock the event loop's time() reads
        self.placement: Placement | None = None
        self.num_tokens = 0  # over every choice
        self.num_cached_tokens = 0  # prompt tokens the prefix cache served (prefill worker)
        self._deadline = arrival + ctx.config.request_timeout_s
        self.choices = [ChoiceState(i, parsed, ctx.tokenizer) for i in range(parsed.sampling.n)]
        self._workers_done = False  # True once no worker can still be running the request
        self._first_at: float | None = None
        self._last_at: float | None = None
        self._delivered_at = arrival
        # Called once, when the first output token is observed (admission: leaves the queue).
        self.on_first_token: Callable[[], None] | None = None

    async def pieces(self) -> AsyncIterator[Piece]:
        plan = await self._route()
        queue = self.ctx.dataplane.register(self.rid)
        self.ctx.pool.track(self.rid, plan)
        try:
            await self._dispatch(plan)
            while True:
                choice, messages = await self._next_in_order(queue)
                for msg in messages:
                    piece = self._deliver(msg, plan, choice)
                    yield piece
                    if all(c.done for c in self.choices):
                        self._observe_end()
                        return
        finally:
            self._close(plan)

    async def _route(self) -> RoutePlan:
        ctx = self.ctx
        try:
            plan = await ctx.pool.route(self.parsed.prompt_ids, self.parsed.sampling.cache_salt)
        except NoWorkersError as e:
            raise APIError(503, f"{e}; try again later", code="no_workers") from e
        ctx.metrics.disagg.labels(path=plan.path).inc()
        if ctx.signals is not None:
            ctx.signals.note_route(plan.path, len(self.parsed.prompt_ids), plan.computed_tokens)
        self.placement = Placement(
            plan.path, (plan.prefill or plan.decode).worker_id, plan.decode.worker_id
        )
        ctx.metrics.prompt_tokens.inc(len(self.parsed.prompt_ids))
        return plan

    async def _dispatch(self, plan: RoutePlan) -> None:
        parsed, dataplane = self.parsed, self.ctx.dataplane
        reply_to = dataplane.reply_endpoint
        try:
            if plan.prefill is None:
                request: Any = GenerateRequest(
                    self.rid,
                    parsed.prompt_ids,
                    parsed.sampling,
                    reply_to,
                    prefix_from=_prefix_source(plan),
                )
                await dataplane.send(plan.decode.request_endpoint, request)
            else:
                request = PrefillRequest(
                    self.rid,
                    parsed.prompt_ids,
                    parsed.sampling,
                    reply_to,
                    decode_worker_id=plan.decode.worker_id,
                    decode_endpoint=plan.decode.request_endpoint,
                    prefix_from=_prefix_source(plan),
                )
                await dataplane.send(plan.prefill.request_endpoint, request)
        except SendError as e:
            raise APIError(503, str(e), code="worker_unreachable") from e

    def _gap_deadline(self) -> float | None:
        deadlines = [
            d
            for c in self.choices
            if (d := c.reorder.gap_deadline(self.ctx.config.token_gap_timeout_s)) is not None
        ]
        return min(deadlines, default=None)

    async def _next_in_order(
        self, queue: asyncio.Queue[TokenMessage]
    ) -> tuple[ChoiceState, list[TokenMessage]]:
        """Wait for the next message within the deadlines; its choice and what it made
        deliverable, in order (often nothing: a message ahead of a gap is only buffered)."""
        loop = asyncio.get_running_loop()
        gap_timeout_s = self.ctx.config.token_gap_timeout_s
        while True:
            now = loop.time()
            gap_deadline = self._gap_deadline()
            if gap_deadline is not None and now >= gap_deadline:
                raise APIError(
                    500,
                    f"token stream of request {self.rid} has a gap older than {gap_timeout_s}s",
                    code="token_gap",
                )
            if now >= self._deadline:
                raise APIError(
                    504,
                    f"request {self.rid} timed out after {self.ctx.config.request_timeout_s}s",
                    code="timeout",
                )
            if queue.empty():
                wait = min(self._deadline, math.inf if gap_deadline is None else gap_deadline)
                try:
                    msg = await asyncio.wait_for(queue.get(), timeout=max(wait - now, 0.0))
                except TimeoutError:
                    continue
            else:  # already here: no timer, no task (wait_for's cost per token)
                msg = queue.get_nowait()
            if msg.handoff:  # the decode worker owns it now; not a token
                self.ctx.pool.note_handed_off(self.rid)
                continue
            if msg.choice >= len(self.choices):
                raise APIError(500, f"request {self.rid}: a worker sent choice {msg.choice}")
            choice = self.choices[msg.choice]
            try:
                return choice, choice.reorder.push(msg, loop.time())
            except ReorderError as e:
                raise APIError(500, f"request {self.rid}: {e}", code="token_reorder") from e

    def _deliver(self, d: TokenMessage, plan: RoutePlan, choice: ChoiceState) -> Piece:
        """Account for one in-order delivery of a choice and turn it into text (raises on a
        worker's error or abort)."""
        if d.finish_reason in ("error", "abort"):
            # Remote: the other worker may still hold the request, so it still gets an abort.
            self._workers_done = plan.path == LOCAL
            raise self._worker_failure(d)
        index = choice.index
        if choice.done:  # stopped here by a stop string: later tokens are dropped
            return Piece("", 0, None, index)
        if d.num_cached_tokens:
            self.num_cached_tokens = max(self.num_cached_tokens, d.num_cached_tokens)
        max_tokens = self.parsed.sampling.max_tokens
        tokens = d.token_ids[: max_tokens - choice.num_tokens]
        logprobs = d.logprobs[: len(tokens)] if d.logprobs is not None else None
        if logprobs:
            choice.cumulative_logprob += sum(e[0] for e in logprobs)
        finish = d.finish_reason
        choice.num_tokens += len(tokens)
        self._observe_tokens(len(tokens))
        detok = choice.detok
        shown = tokens
        if finish == "stop" and self.parsed.hide_stop_token and tokens:
            shown = tokens[:-1]  # the EOS / stop token's text, e.g. "</s>", is not the answer
        text = detok.add(shown)
        if detok.stopped:
            finish = "stop"
        elif choice.num_tokens >= max_tokens and finish is None:
            finish = "length"  # the worker overran; cut it off here
        if finish is not None and not detok.stopped:
            text += detok.finish()
            if detok.stopped:
                finish = "stop"
        choice.done = finish is not None
        if choice.done:
            self.ctx.metrics.finished.labels(finish_reason=finish).inc()
        self._workers_done = all(c.reorder.finished for c in self.choices)
        return Piece(text, len(tokens), finish, index, tokens, logprobs, d.prompt_logprobs)

    def _worker_failure(self, d: TokenMessage) -> APIError:
        self.ctx.metrics.finished.labels(finish_reason=d.finish_reason).inc()
        worker = d.worker_id or "?"
        if d.finish_reason == "error":
            return APIError(
                500,
                f"worker {worker} failed request {self.rid}: {d.error or 'unknown error'}",
                code="worker_error",
            )
        return APIError(
            503,
            f"worker {worker} aborted request {self.rid}: {d.error or 'no reason given'}",
            code="worker_abort",
        )

    def _observe_tokens(self, count: int) -> None:
        metrics = self.ctx.metrics
        now = asyncio.get_running_loop().time()
        self._delivered_at = now
        if count:
            if self._first_at is None:
                self._first_at = now
                metrics.ttft.observe(now - self.arrival)
                if self.ctx.signals is not None:
                    self.ctx.signals.note_first_token(now - self.arrival)
                if self.on_first_token is not None:
                    self.on_first_token()
            elif self._last_at is not None:
                metrics.itl.observe(now - self._last_at)
            self._last_at = now
        self.num_tokens += count
        metrics.generation_tokens.inc(count)

    def _observe_end(self) -> None:
        # Timed at the last delivery, not after the caller wrote the last piece out.
        metrics, end = self.ctx.metrics, self._delivered_at
        metrics.e2e.observe(end - self.arrival)
        tpot = None
        if self._first_at is not None and self.num_tokens > 1:
            tpot = (end - self._first_at) / (self.num_tokens - 1)
            metrics.tpot.observe(tpot)
        if self._first_at is not None:
            ttft = self._first_at - self.arrival
            metrics.observe_slo(len(self.parsed.prompt_ids), ttft, tpot)
        if self.ctx.signals is not None:
            self.ctx.signals.note_finished([c.num_tokens for c in self.choices], tpot)

    def _close(self, plan: RoutePlan) -> None:
        self.ctx.dataplane.unregister(self.rid)
        self.ctx.pool.forget(self.rid)
        if not self._workers_done:
            targets = [plan.decode.request_endpoint]
            if plan.prefill is not None:
                targets.append(plan.prefill.request_endpoint)
            self.ctx.spawn(self._abort(targets))

    async def _abort(self, endpoints: list[str]) -> None:
        for endpoint in endpoints:
            try:
                await self.ctx.dataplane.send(endpoint, AbortRequest(self.rid))
            except Exception as e:  # noqa: BLE001 - best effort: the worker may be gone
                log.warning("could not send abort for %s to %s: %s", self.rid, endpoint, e)
