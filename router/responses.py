"""OpenAI response shapes and SSE framing: pure functions, no I/O.

A non-streaming request answers one `completion_body`; a streaming one answers `stream_headers`,
then (chat only) a first chunk carrying the assistant role, one `chunk` per piece of text, an
optional `usage_chunk`, and `SSE_DONE`. `Placement` (where the request ran) is tandem's
extension: the `tandem` body field and the `X-Tandem-*` headers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from router.openai_api import ParsedRequest


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
    """Unknown request fields, named back to the client (router/request_fields.py)."""
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
) -> dict[str, Any]:
    """One streamed piece of choice `index`; `first` (chat) announces the assistant role."""
    if parsed.kind == "chat":
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
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
    out: dict[str, Any] = {
        "id": rid,
        "object": _chunk_object(parsed),
        "created": created,
        "model": parsed.model,
        "choices": [choice],
    }
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


def sse_event(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event; a str payload (e.g. "[DONE]") is sent as is."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = sse_event("[DONE]")
