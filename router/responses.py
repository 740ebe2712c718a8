"""OpenAI answer shapes: pure functions, no I/O.

A request runs as one `Generation` per prompt (a completions batch has several), each with the
engine's n choices. `ChoiceResult` gathers one choice's text, tokens and logprobs entries
(`(logprob, rank, [(id, logprob), ...])` from engine.sampler); the functions here turn them into
the shapes OpenAI's clients parse:

- completions: `logprobs = {tokens, token_logprobs, top_logprobs, text_offset}`, with the prompt
  first under `echo` (its first token has no logprob, as in OpenAI's and vLLM's answers);
- chat: `logprobs = {content: [{token, logprob, bytes, top_logprobs: [...]}]}`;
- chat tool calls: the text parsed by router/tools.py into `message.tool_calls`;
- best_of ranking, usage with `cached_tokens`.

A non-streaming request answers one `completion_body`; a streaming one answers `stream_headers`,
then (chat only) a first chunk carrying the assistant role, one `chunk` per piece of text, an
optional `usage_chunk`, and `SSE_DONE`. `Placement` (where the request ran) is tandem's
extension: the `tandem` body field and the `X-Tandem-*` headers.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from router.errors import bad_request
from router.openai_api import ParsedRequest
from router.openai_fields import MAX_REQUEST_ID, REQUEST_ID_PATTERN

_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)


def answer_ids(prefix: str, parsed: ParsedRequest, header: str | None) -> tuple[str, str]:
    """(the answer's id, the id the request runs under). vLLM's rule for the first:
    `<prefix>-<id>` with the id from an `X-Request-Id` header, else the body's `request_id`,
    else a fresh one. The second is always fresh: two clients may choose the same id, and the
    router's queues, the workers' requests and the KV hand-offs are keyed by it."""
    run_id = f"{prefix}-{uuid.uuid4().hex}"
    if header is not None and (len(header) > MAX_REQUEST_ID or not _REQUEST_ID.match(header)):
        message = f"the X-Request-Id header must be 1 to {MAX_REQUEST_ID} visible ASCII characters"
        raise bad_request(message, "X-Request-Id", "invalid_request_id")
    chosen = header if header is not None else parsed.request_id
    return (run_id if chosen is None else f"{prefix}-{chosen}"), run_id


@dataclass(slots=True, frozen=True)
class Placement:
    """Which workers served a request (`path` is policy.LOCAL or policy.REMOTE)."""

    path: str
    prefill_worker: str
    decode_worker: str

    def as_dict(self) -> dict[str, str]:
        return {
            "path": self.path,
            "prefill_worker": self.prefill_worker,
            "decode_worker": self.decode_worker,
        }

    def headers(self) -> dict[str, str]:
        return {
            "X-Tandem-Path": self.path,
            "X-Tandem-Prefill-Worker": self.prefill_worker,
            "X-Tandem-Decode-Worker": self.decode_worker,
        }


def placement_headers(placement: Placement | None) -> dict[str, str]:
    return {} if placement is None else placement.headers()


def ignored_headers(parsed: ParsedRequest) -> dict[str, str]:
    """Unknown request fields, named back to the client (router/protocol.py)."""
    if not parsed.ignored_fields:
        return {}
    # Names are the client's: percent-quoted, so a control character or a comma in one can
    # neither break the header nor split it.
    names = ",".join(quote(name, safe="") for name in parsed.ignored_fields)
    return {"X-Tandem-Ignored-Fields": names[:1000]}


def completion_body(
    parsed: ParsedRequest,
    rid: str,
    created: int,
    choices: list[dict[str, Any]],
    usage: dict[str, Any],
    placement: Placement | None,
) -> dict[str, Any]:
    """The whole answer of a non-streaming completion or chat completion."""
    return {
        "id": rid,
        "object": "chat.completion" if parsed.kind == "chat" else "text_completion",
        "created": created,
        "model": parsed.model,
        "choices": choices,
        "usage": usage,
        "tandem": {} if placement is None else placement.as_dict(),
    }


def _chunk_object(parsed: ParsedRequest) -> str:
    # Streamed legacy completions keep the non-streaming object name, as OpenAI does.
    return "chat.completion.chunk" if parsed.kind == "chat" else "text_completion"


def chunk(
    parsed: ParsedRequest,
    rid: str,
    created: int,
    text: str | None,
    finish_reason: str | None,
    *,
    first: bool = False,
    index: int = 0,
    logprobs: dict | None = None,
    tool_calls: list | None = None,
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
    reasoning: str = "",
) -> dict[str, Any]:
    """One streamed piece of choice `index`; `first` (chat) announces the assistant role;
    `reasoning` (chat): a reasoning model's thinking, under both names clients read.
    `token_ids` / `prompt_token_ids` (vLLM's return_token_ids): the piece's tokens; the prompt's
    on a chat role chunk, or on a completions choice's first chunk."""
    if parsed.kind == "chat":
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if text is not None and (text or not reasoning):
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(tool_calls)]
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    else:
        choice = {
            "index": index,
            "text": text or "",
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        if prompt_token_ids is not None:
            choice["prompt_token_ids"] = prompt_token_ids
    if token_ids is not None:
        choice["token_ids"] = token_ids
    out: dict[str, Any] = {
        "id": rid,
        "object": _chunk_object(parsed),
        "created": created,
        "model": parsed.model,
        "choices": [choice],
    }
    if parsed.kind == "chat" and prompt_token_ids is not None:
        out["prompt_token_ids"] = prompt_token_ids
    if parsed.include_usage:
        out["usage"] = None  # OpenAI sends the key on every chunk once usage is asked for
    return out


def usage_chunk(
    parsed: ParsedRequest, rid: str, created: int, usage: dict[str, Any]
) -> dict[str, Any]:
    """The last chunk before [DONE] when stream_options.include_usage is set."""
    return {
        "id": rid,
        "object": _chunk_object(parsed),
        "created": created,
        "model": parsed.model,
        "choices": [],
        "usage": usage,
    }


def stream_headers(rid: str, placement: Placement | None, parsed: ParsedRequest) -> dict[str, str]:
    return {
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
        "X-Request-Id": rid,
        **placement_headers(placement),
        **ignored_headers(parsed),
    }


# What `json.dumps(payload, separators=(",", ":"))` uses, built once: dumps with any argument
# builds a new encoder per call (a per-token cost on a stream).
_COMPACT = json.JSONEncoder(separators=(",", ":")).encode


def sse_event(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event; a str payload (e.g. "[DONE]") is sent as is."""
    data = payload if isinstance(payload, str) else _COMPACT(payload)
    return f"data: {data}\n\n".encode()


SSE_DONE = sse_event("[DONE]")


class TextEvents:
    """`sse_event(chunk(parsed, rid, created, text, finish, index=i))` of one stream, for a
    plain text piece (no role, logprobs or tool calls): the same bytes, from the chunk's
    fields encoded once per stream, so a token costs one string encode instead of a dict and
    an encoder pass over it."""

    def __init__(self, parsed: ParsedRequest, rid: str, created: int) -> None:
        head = {"id": rid, "object": _chunk_object(parsed), "created": created}
        head["model"] = parsed.model
        self._head = "data: " + _COMPACT(head)[:-1] + ',"choices":[{"index":'
        self._text_key = ',"delta":{"content":' if parsed.kind == "chat" else ',"text":'
        self._after_text = "}" if parsed.kind == "chat" else ""
        self._tail = "}]" + (',"usage":null' if parsed.include_usage else "") + "}\n\n"

    def event(self, index: int, text: str, finish_reason: str | None) -> bytes:
        return (
            f"{self._head}{int(index)}{self._text_key}{_COMPACT(text)}{self._after_text}"
            f',"logprobs":null,"finish_reason":{_COMPACT(finish_reason)}{self._tail}'
        ).encode()


# ------------------------------------------------------------------ choices


@dataclass(slots=True)
class ChoiceResult:
    index: int
    text: str = ""
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    entries: list = field(default_factory=list)  # logprobs entries of token_ids, when asked
    prompt_entries: list | None = None
    cumulative_logprob: float = 0.0


class TokenText:
    """Per-token strings for logprobs (cached: the same ids recur in every top list);
    `as_ids` (vLLM's return_tokens_as_token_ids): `token_id:<id>`, for tokens that are not
    text on their own (a byte of a character)."""

    def __init__(self, tokenizer: Any, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 65536:
                self._cache[token_id] = text
        return text


def completion_logprobs(
    text_of: TokenText, token_ids: list[int], entries: list, offset: int = 0
) -> dict[str, list]:
    """OpenAI legacy completions logprobs for `token_ids` (entries may start with None: the
    first prompt token). `offset` is the text offset of the first token."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries, strict=True):
        s = text_of(token)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        lp, _, top = entry
        token_lps.append(lp)
        # vLLM lists the chosen token beside the top k, so a client always finds it.
        ranked = {text_of(i): v for i, v in top}
        ranked.setdefault(s, lp)
        tops.append(ranked)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _chat_entry(text_of: TokenText, token: int, logprob: float) -> dict[str, Any]:
    s = text_of(token)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(text_of: TokenText, token_ids: list[int], entries: list) -> dict[str, list]:
    content = []
    for token, (lp, _, top) in zip(token_ids, entries, strict=True):
        item = _chat_entry(text_of, token, lp)
        item["top_logprobs"] = [_chat_entry(text_of, i, v) for i, v in top]
        content.append(item)
    return {"content": content}


def best_of(results: list[ChoiceResult], n: int) -> list[ChoiceResult]:
    """The n choices with the highest cumulative logprob, re-indexed in that order (vLLM)."""
    ranked = sorted(results, key=lambda r: r.cumulative_logprob, reverse=True)[:n]
    for i, r in enumerate(ranked):
        r.index = i
    return ranked


def tool_message(
    parsed: ParsedRequest, text: str | None, reasoning: str | None = None
) -> tuple[dict[str, Any], bool]:
    """The chat message for `text` under the request's tools: (message, has tool calls).
    `reasoning`: a reasoning model's thinking (None: none, or no split), under both names."""
    message, called = _answer_message(parsed, text)
    if reasoning is not None:
        message["reasoning"] = message["reasoning_content"] = reasoning
    return message, called


def _answer_message(parsed: ParsedRequest, text: str | None) -> tuple[dict[str, Any], bool]:
    from router.tools import opens_call, parse_tool_calls

    if parsed.tool_choice in (None, "none") or not parsed.tools or text is None:
        return {"role": "assistant", "content": text}, False
    if (
        parsed.tool_choice == "auto"
        and parsed.tool_grammar
        and opens_call(text, parsed.tool_format)
    ):
        # Only calls (the grammar's other branch never opens one); a cut one keeps its
        # arguments so far, as forced calls do.
        calls, content = forced_tool_calls(parsed, text), None
    elif parsed.tool_choice == "auto":
        out = parse_tool_calls(text, parsed.tool_format)
        calls, content = out.tool_calls, out.content
    else:
        calls, content = forced_tool_calls(parsed, text), None
    calls = calls if parsed.parallel_tool_calls else calls[:1]
    if not calls:
        return {"role": "assistant", "content": text}, False
    return {"role": "assistant", "content": content, "tool_calls": calls}, True


def forced_tool_calls(parsed: ParsedRequest, text: str) -> list[dict[str, Any]]:
    """tool_choice "required" (a JSON list of {name, parameters}) or a named function (the
    arguments object): the calls as the model wrote them; a call the length limit cut keeps
    its arguments so far (OpenAI's shape, with finish_reason "length")."""
    from router.tool_stream import ForcedCallParser

    # "auto" under auto_tools_grammar: Hermes blocks, read like a "required" list.
    parser = ForcedCallParser(None if parsed.tool_choice == "auto" else parsed.tool_choice)
    parser.feed(text)
    return parser.calls()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
