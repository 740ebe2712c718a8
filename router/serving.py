"""One HTTP request's generations and their answer, streamed or whole.

A completions request with a list of prompts runs one `Generation` per prompt (engine request
ids `<rid>-<i>`), concurrently; each carries the engine's n choices. Choice `c` of prompt `p`
answers as OpenAI index `p * n + c`. Whole answers (`answer_body`) wait for every choice;
streams (`stream_chunks`) merge the generations' pieces as they come, one chunk per piece.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from router import responses
from router.generation import Generation, GenerationContext, Piece
from router.openai_api import ParsedRequest
from router.reasoning import ReasoningSplit, split_whole
from router.responses import ChoiceResult, TokenText

_END = object()


class RequestRun:
    def __init__(
        self, ctx: GenerationContext, parsed: ParsedRequest, ids: tuple[str, str], arrival: float
    ):
        """`ids`: the answer's id (`rid`, in every body and chunk) and the one the request runs
        under (unique, the engine requests' ids: router/responses.py `answer_ids`)."""
        self.parsed = parsed
        self.rid, run_id = ids
        self.text_of = TokenText(ctx.tokenizer, parsed.tokens_as_ids)
        self.tokenizer = ctx.tokenizer
        many = len(parsed.prompts) > 1
        self.generations = [
            Generation(ctx, _for_prompt(parsed, p), f"{run_id}-{i}" if many else run_id, arrival)
            for i, p in enumerate(parsed.prompts)
        ]

    def set_first_token_callback(self, callback: Callable[[], None]) -> None:
        """Call `callback` once, at the first output token of any of the generations."""
        fired = False

        def once() -> None:
            nonlocal fired
            if not fired:
                fired = True
                callback()

        for generation in self.generations:
            generation.on_first_token = once

    @property
    def placement(self):
        return self.generations[0].placement

    @property
    def num_completion_tokens(self) -> int:
        return 0 if self.parsed.echo_only else sum(g.num_tokens for g in self.generations)

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(p) for p in self.parsed.prompts)
        cached = sum(g.num_cached_tokens for g in self.generations)
        return responses.usage(prompt, self.num_completion_tokens, cached)

    # ------------------------------------------------------------------ whole answers

    async def results(self) -> list[ChoiceResult]:
        """Every choice of every prompt, whole (gathered from the same merged stream the
        streaming answer reads, so a client that goes away aborts both the same way)."""
        n = self.parsed.sampling.n
        per_prompt = [[ChoiceResult(i) for i in range(n)] for _ in self.generations]
        async with contextlib.aclosing(self.pieces()) as pieces:
            async for p, piece in pieces:
                _add(per_prompt[p][piece.choice], piece)
        out: list[ChoiceResult] = []
        for p, (results, generation) in enumerate(zip(per_prompt, self.generations, strict=True)):
            for r, state in zip(results, generation.choices, strict=True):
                r.cumulative_logprob = state.cumulative_logprob
            if n > self.parsed.n:
                results = responses.best_of(results, self.parsed.n)
            for r in results:
                r.index += p * self.parsed.n
            out += results
        return out

    def choice_body(self, r: ChoiceResult, prompt_ids: list[int]) -> dict[str, Any]:
        parsed = self.parsed
        if parsed.kind == "chat":
            text = parsed.extra.get("echo_text", "") + r.text
            reasoning = None
            if parsed.reasoning_mode is not None:
                reasoning, text = split_whole(parsed.reasoning_mode, text)
            message, called = responses.tool_message(parsed, text, reasoning)
            logprobs = None
            if parsed.logprobs is not None:
                logprobs = responses.chat_logprobs(self.text_of, r.token_ids, r.entries)
            # A call cut by the length limit is returned, with finish_reason "length".
            finish = "tool_calls" if called and r.finish_reason != "length" else r.finish_reason
            body = {"index": r.index, "message": message, "logprobs": logprobs}
            body["finish_reason"] = finish
            return body | ({"token_ids": r.token_ids} if parsed.return_token_ids else {})
        body = {
            "index": r.index,
            "text": self._completion_text(r, prompt_ids),
            "logprobs": self._completion_logprobs(r, prompt_ids),
            "finish_reason": "length" if parsed.echo_only else r.finish_reason,
        }
        if parsed.return_token_ids:  # vLLM's: the answer's tokens, not the echoed prompt's
            body["prompt_token_ids"] = prompt_ids
            body["token_ids"] = [] if parsed.echo_only else r.token_ids
        return body

    def _completion_text(self, r: ChoiceResult, prompt_ids: list[int]) -> str:
        parsed = self.parsed
        out = "" if parsed.echo_only else r.text
        if parsed.echo:
            out = self.tokenizer.decode(prompt_ids, skip_special_tokens=False) + out
        return out

    def _completion_logprobs(self, r: ChoiceResult, prompt_ids: list[int]) -> dict | None:
        parsed = self.parsed
        if parsed.logprobs is None:
            return None
        ids: list[int] = [] if parsed.echo_only else list(r.token_ids)
        entries: list = [] if parsed.echo_only else list(r.entries)
        if parsed.echo:
            prompt_entries = r.prompt_entries or [None] * len(prompt_ids)
            ids, entries = prompt_ids + ids, prompt_entries + entries
        return responses.completion_logprobs(self.text_of, ids, entries)

    async def answer_body(self, created: int) -> dict[str, Any]:
        results = await self.results()
        n = self.parsed.n
        choices = [self.choice_body(r, self.parsed.prompts[r.index // n]) for r in results]
        body = responses.completion_body(
            self.parsed, self.rid, created, choices, self.usage(), self.placement
        )
        if self.parsed.return_token_ids and self.parsed.kind == "chat":
            body["prompt_token_ids"] = self.parsed.prompt_ids
        return body

    # ------------------------------------------------------------------ streams

    async def pieces(self) -> AsyncIterator[tuple[int, Piece]]:
        """(prompt index, piece) from every generation as they come. Closing this closes them
        all, which aborts their requests on the workers. One prompt is read in the caller's
        task; a batch is read by one task per prompt, each of which also stops on its own at
        its next piece once this is closed (Python 3.11's wait_for can swallow a
        cancellation that lands as a token arrives)."""
        if len(self.generations) == 1:
            async with contextlib.aclosing(self.generations[0].pieces()) as pieces:
                async for piece in pieces:
                    yield 0, piece
            return
        queue: asyncio.Queue = asyncio.Queue()
        closed = asyncio.Event()

        async def pump(p: int, generation: Generation) -> None:
            try:
                async with contextlib.aclosing(generation.pieces()) as pieces:
                    async for piece in pieces:
                        if closed.is_set():
                            return
                        queue.put_nowait((p, piece))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait(e)
                return
            queue.put_nowait(_END)

        tasks = [asyncio.create_task(pump(p, g)) for p, g in enumerate(self.generations)]
        try:
            ended = 0
            while ended < len(tasks):
                item = await queue.get()
                if item is _END:
                    ended += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            closed.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _add(r: ChoiceResult, piece: Piece) -> None:
    r.text += piece.text
    r.finish_reason = piece.finish_reason or r.finish_reason
    r.token_ids += piece.token_ids
    if piece.logprobs:
        r.entries += piece.logprobs
    if piece.prompt_logprobs is not None:
        r.prompt_entries = piece.prompt_logprobs


def _for_prompt(parsed: ParsedRequest, prompt_ids: list[int]) -> ParsedRequest:
    """The request as one prompt's generation sees it."""
    return replace(parsed, prompt_ids=prompt_ids, prompts=[prompt_ids])


class StreamWriter:
    """Turns (prompt index, piece) pairs into chunks: echo before a choice's first piece, its
    logprobs beside its text, tool calls held back and sent as `tool_calls` deltas."""

    def __init__(self, run: RequestRun, created: int) -> None:
        self.run = run
        self.created = created
        self.started: set[int] = set()
        self.tool_parsers: dict[int, Any] = {}
        self.forced: dict[int, Any] = {}  # forced tool calls: a ForcedCallParser per choice
        self.called: set[int] = set()  # choices that returned tool calls
        self.thinking: dict[int, ReasoningSplit] = {}  # a reasoning model's, per choice
        parsed = run.parsed
        # No echo, logprobs or tools: a piece's chunk is its text and finish reason alone.
        self._plain = not (
            parsed.echo
            or parsed.echo_only
            or parsed.extra.get("echo_text")
            or parsed.logprobs is not None
            or (parsed.kind == "chat" and parsed.tools and parsed.tool_choice not in (None, "none"))
            or parsed.continuous_usage
            or parsed.return_token_ids
            or parsed.reasoning_mode is not None
        )
        self.generated: dict[int, int] = {}  # choice index -> tokens so far (continuous usage)
        self.text_events = responses.TextEvents(parsed, run.rid, created)

    def role_events(self) -> list[bytes]:
        """The server-sent events of `role_chunks`."""
        return [responses.sse_event(chunk) for chunk in self.role_chunks()]

    def role_chunks(self) -> list[dict[str, Any]]:
        parsed = self.run.parsed
        if parsed.kind != "chat":
            return []
        total = len(parsed.prompts) * parsed.n
        ids = parsed.prompt_ids if parsed.return_token_ids else None
        return [
            self._usage_of(
                responses.chunk(
                    parsed,
                    self.run.rid,
                    self.created,
                    "",
                    None,
                    first=True,
                    index=i,
                    prompt_token_ids=ids,
                ),
                i,
            )
            for i in range(total)
        ]

    def _usage_of(self, chunk: dict[str, Any], index: int) -> dict[str, Any]:
        """`chunk` with its choice's usage so far when continuous usage stats are asked for
        (vLLM's form: the prompt's tokens and the choice's generated tokens)."""
        parsed = self.run.parsed
        if parsed.continuous_usage:
            prompt, done = len(parsed.prompts[index // parsed.n]), self.generated.get(index, 0)
            chunk["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": done,
                "total_tokens": prompt + done,
            }
        return chunk

    def events(self, p: int, piece: Piece) -> list[bytes]:
        """The server-sent events of `chunks(p, piece)`: the same bytes."""
        if not self._plain:
            return [responses.sse_event(chunk) for chunk in self.chunks(p, piece)]
        text, finish = piece.text, piece.finish_reason
        if not text and finish is None:
            return []
        return [self.text_events.event(p * self.run.parsed.n + piece.choice, text, finish)]

    def chunks(self, p: int, piece: Piece) -> list[dict[str, Any]]:
        parsed = self.run.parsed
        index = p * parsed.n + piece.choice
        if not parsed.echo_only:
            self.generated[index] = self.generated.get(index, 0) + piece.num_tokens
        first = index not in self.started
        text, logprobs = self._text_and_logprobs(p, index, piece)
        reasoning = ""
        if parsed.reasoning_mode is not None:
            reasoning, text = self._split(index, text, piece.finish_reason)
        tool_calls = None
        if parsed.kind == "chat" and parsed.tools and parsed.tool_choice not in (None, "none"):
            text, tool_calls = self._tools(index, text, piece.finish_reason)
        finish = piece.finish_reason
        if tool_calls:
            self.called.add(index)
        if index in self.called and finish == "stop":
            finish = "tool_calls"
        ids = ([] if parsed.echo_only else piece.token_ids) if parsed.return_token_ids else None
        if not (text or reasoning) and finish is None and not (tool_calls or logprobs or ids):
            return []  # (a token held back, say by a stop string, still shows its id)
        prompt_ids = None
        if parsed.return_token_ids and parsed.kind != "chat" and first:
            prompt_ids = parsed.prompts[p]  # chat: on the role chunk
        chunk = responses.chunk(
            parsed,
            self.run.rid,
            self.created,
            text,
            finish,
            index=index,
            logprobs=logprobs,
            tool_calls=tool_calls,
            token_ids=ids,
            prompt_token_ids=prompt_ids,
            reasoning=reasoning,
        )
        return [self._usage_of(chunk, index)]

    def _split(self, index: int, text: str, finish: str | None) -> tuple[str, str]:
        """(thinking, answer) of a piece of a reasoning model's answer (router/reasoning.py)."""
        mode = self.run.parsed.reasoning_mode
        assert mode is not None
        split = self.thinking.setdefault(index, ReasoningSplit(mode))
        reasoning, content = split.feed(text)
        if finish is not None:
            more_reasoning, more_content = split.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def _text_and_logprobs(self, p: int, index: int, piece: Piece) -> tuple[str, dict | None]:
        run, parsed = self.run, self.run.parsed
        ids = [] if parsed.echo_only else piece.token_ids
        entries = [] if parsed.echo_only or not piece.logprobs else piece.logprobs
        text = "" if parsed.echo_only else piece.text
        prefix_ids: list[int] = []
        prefix_entries: list = []
        if index not in self.started:
            self.started.add(index)
            if parsed.echo:
                prefix_ids = parsed.prompts[p]
                text = run.tokenizer.decode(prefix_ids, skip_special_tokens=False) + text
                prefix_entries = piece.prompt_logprobs or [None] * len(prefix_ids)
            if parsed.kind == "chat" and parsed.extra.get("echo_text"):
                text = parsed.extra["echo_text"] + text
        if parsed.logprobs is None:
            return text, None
        if parsed.kind == "chat":
            return text, responses.chat_logprobs(run.text_of, ids, entries)
        return text, responses.completion_logprobs(
            run.text_of, prefix_ids + ids, prefix_entries + entries
        )

    def _tools(self, index: int, text: str, finish: str | None) -> tuple[str | None, list | None]:
        from router.tool_stream import ForcedCallParser, ToolStreamParser

        parsed = self.run.parsed
        if parsed.tool_choice == "auto":
            parser = self.tool_parsers.setdefault(index, ToolStreamParser(parsed.tool_format))
            content = parser.feed(text)
            if parsed.tool_grammar and parser.in_tool_calls:
                # The grammar made the call valid: stream it like a forced one.
                calls_parser = self.forced.setdefault(index, ForcedCallParser(None))
                deltas = calls_parser.feed(parser.held[len(calls_parser.text) :])
                if finish is not None:
                    self.forced.pop(index)
                return content, deltas or None
            if finish is None:
                return content, None
            rest = parser.finish()
            calls = rest.tool_calls if parsed.parallel_tool_calls else rest.tool_calls[:1]
            return content + (rest.content or ""), calls or None
        parser = self.forced.setdefault(index, ForcedCallParser(parsed.tool_choice))
        deltas = parser.feed(text)  # the arguments stream as they are generated
        if finish is not None:
            self.forced.pop(index)
        return None, deltas or None
