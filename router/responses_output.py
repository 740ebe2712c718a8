"""The answer shapes of `/v1/responses`: pure, no I/O.

The response object (`response_object`: OpenAI's fields, the request's settings echoed, usage
as input/output tokens), its output items (an assistant `message` with one `output_text` part,
then `function_call` items), and the server-sent events of a streamed answer
(`ResponseEvents`), as OpenAI sends them:

`event: <type>` / `data: {"type", "sequence_number", ...}` pairs, no `[DONE]` (the stream ends
with the connection): response.created and response.in_progress (the response object with
status "in_progress" and no output), then for the message item response.output_item.added,
response.content_part.added, response.output_text.delta per piece of text,
response.output_text.done, response.content_part.done, response.output_item.done; for each
function call response.output_item.added, response.function_call_arguments.delta (the whole
arguments: a call is known only once its text is complete), .done and
response.output_item.done; last response.completed, or response.incomplete when the token
limit cut the output. A failure after the first event is an `error` event.

Text goes out as it is generated. With tools, "auto" text passes through router/tools.py's
streaming parser (call text is held back and becomes function calls at the end); a forced
call's text is held whole. The final response object is built by the same function as a
whole answer's (`response_object`), from the items the events carried.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from router import responses
from router.errors import APIError
from router.openai_api import ParsedRequest
from router.reasoning import ReasoningSplit, split_whole
from router.responses_protocol import ResponsesRequest
from router.tool_stream import ToolStreamParser

_COMPACT = json.JSONEncoder(separators=(",", ":")).encode


@dataclass(slots=True)
class ResponsesCall:
    """One /v1/responses request, converted: what `respond` answers and stores."""

    req: ResponsesRequest
    parsed: ParsedRequest
    rid: str
    history: list[dict[str, Any]]  # the stored conversation before this request's input
    items: list[dict[str, Any]]  # this request's input items
    created_at: int = field(default_factory=lambda: int(time.time()))


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    content = [part] if status != "in_progress" else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": content}  # fmt: skip


def function_call_item(call: dict[str, Any], status: str, item_id: str) -> dict[str, Any]:
    """A chat tool call ({"id", "function": {"name", "arguments"}}) as an output item."""
    fn = call["function"]
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"], "status": status}  # fmt: skip


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A reasoning model's thinking (router/reasoning.py) as OpenAI's reasoning output item."""
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
            "encrypted_content": None, "status": status}  # fmt: skip


def output_items(
    content: str | None, calls: list[dict], status: str, reasoning: str | None = None
) -> list[dict[str, Any]]:
    """The output: the thinking, if any, then a message (when there is text, or nothing else)
    then the function calls."""
    out = [] if reasoning is None else [reasoning_item(new_id("rs"), reasoning, "completed")]
    if content or not (calls or out):
        out.append(message_item(new_id("msg"), content or "", status))
    out += [function_call_item(c, "completed", new_id("fc")) for c in calls]
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(chat_usage: dict[str, Any], reasoning_tokens: int = 0) -> dict[str, Any]:
    cached = chat_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": chat_usage["total_tokens"],
    }


def _text_config(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return {"format": {"type": "text"}}
    out = fmt.model_dump(by_alias=True, exclude_none=True)
    if "schema" in out:
        out["schema"] = json.loads(out["schema"])
    return {"format": out}


def _tool_choice(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if choice is None:
        return "auto" if req.tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()


def response_object(
    call: ResponsesCall, status: str, output: list[dict], usage: dict[str, Any] | None
) -> dict[str, Any]:
    """The response object: OpenAI's fields, the request's settings echoed."""
    req, sampling = call.req, call.parsed.sampling
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": call.rid,
        "object": "response",
        "created_at": call.created_at,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": call.parsed.model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": None,
        "store": req.store is not False,
        "temperature": sampling.temperature,
        "text": _text_config(req),
        "tool_choice": _tool_choice(req),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
        "top_p": sampling.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def answer_output(parsed: ParsedRequest, text: str, finish: str | None) -> tuple[str, list]:
    """(status, output items) of a whole generated text."""
    reasoning = None
    if parsed.reasoning_mode is not None:
        reasoning, text = split_whole(parsed.reasoning_mode, text)
    message, _ = responses.tool_message(parsed, text)
    status = "incomplete" if finish == "length" else "completed"
    calls = message.get("tool_calls") or []
    return status, output_items(message.get("content"), calls, status, reasoning)


def conversation_items(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as normalized conversation items (what chat_messages reads)."""
    out = []
    for item in output:
        if item["type"] == "message":
            text = "".join(p["text"] for p in item["content"])
            out.append({"type": "message", "role": "assistant", "content": text})
        elif item["type"] == "reasoning":
            text = "".join(p["text"] for p in item["content"])
            out.append({"type": "reasoning", "text": text})
        else:
            keys = ("call_id", "name", "arguments")
            out.append({"type": "function_call", **{k: item[k] for k in keys}})
    return out


# ------------------------------------------------------------------ stream events


class ResponseEvents:
    def __init__(self, call: Any) -> None:
        self.call = call
        parsed = call.parsed
        tools_on = bool(parsed.tools) and parsed.tool_choice not in (None, "none")
        self.mode = "text" if not tools_on else "auto" if parsed.tool_choice == "auto" else "held"
        self.parser = ToolStreamParser(parsed.tool_format) if self.mode == "auto" else None
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.message_id: str | None = None  # the message item, once opened
        self.text = ""  # the message's text so far
        self.held = ""  # a forced call's text
        self.body: dict[str, Any] = {}  # the final response object
        self.finish_reason: str | None = None
        self.message_index = 0  # the message item's place in the output
        # A reasoning model's thinking (router/reasoning.py): its item, open while it grows.
        mode = parsed.reasoning_mode
        self.split = ReasoningSplit(mode) if mode is not None else None
        self.thought_id: str | None = None
        self.thought, self.thinking_open = "", False
        self.token_ids: list[int] = []  # the answer's (its thinking tokens are counted)

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {_COMPACT(payload)}\n\n".encode()

    def start(self) -> list[bytes]:
        body = response_object(self.call, "in_progress", [], None)
        return [
            self.event("response.created", response=body),
            self.event("response.in_progress", response=body),
        ]

    def piece(self, piece: Any) -> list[bytes]:
        self.finish_reason = piece.finish_reason or self.finish_reason
        self.token_ids += piece.token_ids
        if self.split is None:
            return self._answer(piece.text)
        reasoning, content = self.split.feed(piece.text)
        return self._thinking(reasoning) + self._answer(content)

    def _answer(self, text: str) -> list[bytes]:
        if self.mode == "text":
            return self._text(text)
        if self.mode == "auto":
            return self._text(self.parser.feed(text))
        self.held += text
        return []

    def _thinking(self, delta: str) -> list[bytes]:
        """A piece of thinking: its item opened first (content_index 0 of a reasoning_text)."""
        if not delta:
            return []
        out = []
        if self.thought_id is None:
            self.thought_id, self.thinking_open = new_id("rs"), True
            item = reasoning_item(self.thought_id, "", "in_progress")
            part = {"type": "reasoning_text", "text": ""}
            out += [
                self.event("response.output_item.added", output_index=len(self.output), item=item),
                self.event("response.content_part.added", **self._thought_at(), part=part),
            ]
        self.thought += delta
        return out + [
            self.event("response.reasoning_text.delta", **self._thought_at(), delta=delta)
        ]

    def _thought_at(self) -> dict[str, Any]:
        return {"item_id": self.thought_id, "output_index": len(self.output), "content_index": 0}

    def _close_thinking(self) -> list[bytes]:
        if not self.thinking_open:
            return []
        self.thinking_open = False
        at, text = self._thought_at(), self.thought
        item = reasoning_item(self.thought_id, text, "completed")
        part = {"type": "reasoning_text", "text": text}
        self.output.append(item)
        return [
            self.event("response.reasoning_text.done", **at, text=text),
            self.event("response.content_part.done", **at, part=part),
            self.event("response.output_item.done", output_index=at["output_index"], item=item),
        ]

    def _text(self, delta: str) -> list[bytes]:
        if not delta:
            return []
        out = self._open_message()
        self.text += delta
        where = {"item_id": self.message_id, "output_index": self.message_index, "content_index": 0}
        out.append(self.event("response.output_text.delta", **where, delta=delta, logprobs=[]))
        return out

    def _open_message(self) -> list[bytes]:
        if self.message_id is not None:
            return []
        closed = self._close_thinking()
        self.message_id, self.message_index = new_id("msg"), len(self.output)
        item = message_item(self.message_id, "", "in_progress")
        part = {"type": "output_text", "text": "", "annotations": []}
        where = {"item_id": self.message_id, "output_index": self.message_index, "content_index": 0}
        return closed + [
            self.event("response.output_item.added", output_index=self.message_index, item=item),
            self.event("response.content_part.added", **where, part=part),
        ]

    def finish(self, usage: dict[str, Any]) -> list[bytes]:
        """The events after the last piece; `body` holds the final response object."""
        out: list[bytes] = []
        calls: list[dict[str, Any]] = []
        if self.split is not None:
            reasoning, content = self.split.finish()
            out += self._thinking(reasoning) + self._answer(content)
        if self.mode == "auto":
            rest = self.parser.finish()
            out += self._text(rest.content or "")
            calls = rest.tool_calls
        elif self.mode == "held":
            calls = responses.forced_tool_calls(self.call.parsed, self.held)
            if not calls:  # the token limit cut the call: its text is all there is
                out += self._text(self.held)
        status = "incomplete" if self.finish_reason == "length" else "completed"
        out += self._close_thinking()
        if self.message_id is not None or not (calls or self.output):
            out += self._close_message(status)
        for c in calls:
            out += self._function_call(c)
        self.body = response_object(self.call, status, self.output, usage)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        out.append(self.event(kind, response=self.body))
        return out

    def _close_message(self, status: str) -> list[bytes]:
        out = self._open_message()
        where = {"item_id": self.message_id, "output_index": self.message_index, "content_index": 0}
        part = {"type": "output_text", "text": self.text, "annotations": []}
        item = message_item(self.message_id, self.text, status)
        self.output.append(item)
        return out + [
            self.event("response.output_text.done", **where, text=self.text, logprobs=[]),
            self.event("response.content_part.done", **where, part=part),
            self.event("response.output_item.done", output_index=self.message_index, item=item),
        ]

    def _function_call(self, call: dict[str, Any]) -> list[bytes]:
        index, item_id = len(self.output), new_id("fc")
        args = call["function"]["arguments"]
        added = function_call_item(call, "in_progress", item_id) | {"arguments": ""}
        item = function_call_item(call, "completed", item_id)
        self.output.append(item)
        where = {"item_id": item_id, "output_index": index}
        return [
            self.event("response.output_item.added", output_index=index, item=added),
            self.event("response.function_call_arguments.delta", **where, delta=args),
            self.event("response.function_call_arguments.done", **where, arguments=args),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def error(self, e: APIError) -> bytes:
        return self.event("error", code=e.code, message=e.message, param=e.param)
