"""From pieces to OpenAI choices: log-probability shapes, echo, tool calls, best_of ranking.

A request runs as one `Generation` per prompt (a completions batch has several), each with the
engine's n choices. `ChoiceResult` gathers one choice's text, tokens and logprobs entries
(`(logprob, rank, [(id, logprob), ...])` from engine.sampler); the functions here turn them into
the shapes OpenAI's clients parse:

- completions: `logprobs = {tokens, token_logprobs, top_logprobs, text_offset}`, with the prompt
  first under `echo` (its first token has no logprob, as in OpenAI's and vLLM's answers);
- chat: `logprobs = {content: [{token, logprob, bytes, top_logprobs: [...]}]}`;
- chat tool calls: the text parsed by router/tools.py into `message.tool_calls`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from router.openai_api import ParsedRequest


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
    """Per-token strings for logprobs (cached: the same ids recur in every top list)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
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


def tool_message(parsed: ParsedRequest, text: str) -> tuple[dict[str, Any], bool]:
    """The chat message for `text` under the request's tools: (message, has tool calls)."""
    from router.tools import parse_tool_calls

    if parsed.tool_choice in (None, "none") or not parsed.tools:
        return {"role": "assistant", "content": text}, False
    if parsed.tool_choice == "auto":
        out = parse_tool_calls(text, parsed.tool_format)
        calls = out.tool_calls
        content = out.content
    else:
        calls, content = forced_tool_calls(parsed, text), None
    if not calls:
        return {"role": "assistant", "content": text}, False
    return {"role": "assistant", "content": content, "tool_calls": calls}, True


def forced_tool_calls(parsed: ParsedRequest, text: str) -> list[dict[str, Any]]:
    """tool_choice "required" (a JSON list of {name, parameters}) or a named function (the
    arguments object): the grammar made the text parse, unless the length limit cut it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if parsed.tool_choice == "required":
        pairs = [(c.get("name"), c.get("parameters", {})) for c in value if isinstance(c, dict)]
    else:
        pairs = [(parsed.tool_choice["function"]["name"], value)]
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)},
        }
        for name, args in pairs
    ]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
