"""`/v1/responses` (OpenAI's Responses API) on the chat completions machinery.

Lifecycle of a request: the body is validated as `ResponsesRequest` (router/responses_protocol.py)
-> its conversation (the stored one of `previous_response_id`, then its input items) becomes
chat messages (`instructions` a system message first; `function_call` items assistant
tool calls; `function_call_output` items tool messages) and the request a chat completions
body, parsed by `RequestParser.parse_chat` into the same `ParsedRequest` a chat request gets
(chat template, tools, structured outputs, window, sampling defaults; an error naming a chat
field is renamed to the Responses field) -> admitted and run by the server exactly as chat
(`RouterServer._serve`) -> answered by `ResponsesAPI.respond`: a response object, or its
stream of events (router/responses_output.py) -> stored (`store` not false) in the
`ResponseStore` LRU, which `GET` / `DELETE /v1/responses/{id}` read.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from aiohttp import web

from router import responses
from router.errors import APIError, bad_request
from router.openai_api import RequestParser, _ignored, validate
from router.reasoning import thinking_tokens
from router.response_store import ResponseStore
from router.responses_output import (
    ResponseEvents,
    ResponsesCall,
    answer_output,
    conversation_items,
    new_id,
    response_object,
    response_usage,
)
from router.responses_protocol import ResponsesRequest

log = logging.getLogger(__name__)

# Chat completions fields -> the Responses fields they came from (for error bodies).
_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
}


# vLLM's request fields beyond OpenAI's (sampling, cache_salt, priority): the chat route reads
# them, so a Responses request may set them too (benchmark clients send ignore_eos for fixed
# answer lengths).
VLLM_EXTRAS = (
    "ignore_eos", "min_tokens", "top_k", "min_p", "repetition_penalty", "seed", "stop",
    "stop_token_ids", "presence_penalty", "frequency_penalty", "logit_bias",
    "include_stop_str_in_output", "skip_special_tokens", "cache_salt", "priority",
)  # fmt: skip


# ------------------------------------------------------------------ items -> chat messages


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict]:
    """Normalized Responses items as chat messages (a 400 for a function_call_output whose
    call_id no earlier function_call has)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    calls: set[str] = set()
    thinking: str | None = None  # a reasoning item's, for the assistant turn after it
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            thinking = item["text"]
        elif kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": item["content"]})
        elif kind == "function_call":
            fn = {"name": item["name"], "arguments": item["arguments"]}
            call = {"id": item["call_id"], "type": "function", "function": fn}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and thinking is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            calls.add(item["call_id"])
        else:
            if item["call_id"] not in calls:
                message = (
                    f"No tool call found for function call output with call_id {item['call_id']!r}."
                )
                raise bad_request(message, "input")
            msg = {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            messages.append(msg)
        if thinking is not None and kind != "reasoning" and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"], thinking = thinking, None
    return messages


def chat_body(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completions body that runs `req` over `conversation`."""
    body: dict[str, Any] = {"messages": chat_messages(req.instructions, conversation)}
    for src, dst in (
        ("model", "model"),
        ("max_output_tokens", "max_completion_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("stream", "stream"),
        ("parallel_tool_calls", "parallel_tool_calls"),
    ):
        value = getattr(req, src)
        if value is not None:
            body[dst] = value
    extra = req.model_extra or {}
    body.update({name: extra[name] for name in VLLM_EXTRAS if name in extra})
    if req.tools:
        body["tools"] = [t.as_chat() for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = req.chat_tool_choice()
    if req.text is not None and req.text.format is not None:
        body["response_format"] = req.text.format.as_response_format()
    return body


def _renamed(e: APIError) -> APIError:
    """A chat request's error in the Responses fields' names."""
    param = _PARAMS.get(e.param or "", e.param)
    message = e.message
    for chat, own in _PARAMS.items():
        message = message.replace(f"'{chat}'", f"'{own}'")
    return APIError(e.status, message, param=param, code=e.code, retry_after=e.retry_after)


# ------------------------------------------------------------------ the routes


class StreamFailed(APIError):
    """A stream that already sent its headers and then failed: the error event is written."""

    def __init__(self, resp: web.StreamResponse) -> None:
        super().__init__(500, "stream failed")
        self.resp = resp

    def response(self) -> web.StreamResponse:  # type: ignore[override]
        return self.resp


class ResponsesAPI:
    """Parses /v1/responses bodies, answers them, and serves the stored responses."""

    def __init__(self, parser: RequestParser, store: ResponseStore) -> None:
        self.parser = parser
        self.store = store

    def parse(self, body: bytes | dict) -> ResponsesCall:
        req: ResponsesRequest = validate(ResponsesRequest, body, self.parser.limits)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            stored = self.store.get(req.previous_response_id)
            if stored is None:
                raise APIError(
                    400,
                    f"Previous response with id '{req.previous_response_id}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            history = stored.items
        items = req.items()
        try:
            parsed = self.parser.parse_chat(chat_body(req, history + items))
        except APIError as e:
            raise _renamed(e) from None
        parsed.ignored_fields = [n for n in _ignored(req) if n not in VLLM_EXTRAS]
        return ResponsesCall(req, parsed, new_id("resp"), history, items)

    def _keep(self, call: ResponsesCall, body: dict[str, Any]) -> None:
        if call.req.store is False:
            return
        conversation = call.history + call.items + conversation_items(body["output"])
        self.store.put(call.rid, body, conversation)

    async def respond(self, request: web.Request, run: Any, call: ResponsesCall) -> Any:
        if call.parsed.stream:
            return await self._respond_stream(request, run, call)
        results = await run.results()
        parsed = call.parsed
        status, output = answer_output(parsed, results[0].text, results[0].finish_reason)
        thinking = thinking_tokens(
            parsed.reasoning_mode, results[0].token_ids, self.parser.think_ids
        )
        body = response_object(call, status, output, response_usage(run.usage(), thinking))
        self._keep(call, body)
        headers = {
            **responses.placement_headers(run.placement),
            **responses.ignored_headers(call.parsed),
        }
        return web.json_response(body, headers=headers)

    async def _respond_stream(self, request: web.Request, run: Any, call: ResponsesCall) -> Any:
        events = ResponseEvents(call)
        resp: web.StreamResponse | None = None
        async with contextlib.aclosing(run.pieces()) as pieces:
            try:
                async for _, piece in pieces:
                    if resp is None:
                        headers = responses.stream_headers(run.rid, run.placement, call.parsed)
                        resp = web.StreamResponse(headers=headers)
                        await resp.prepare(request)
                        await resp.write(b"".join(events.start()))
                    for event in events.piece(piece):
                        await resp.write(event)
            except APIError as e:
                if resp is None:
                    raise
                log.warning("response stream %s failed after it started: %s", run.rid, e.message)
                await resp.write(events.error(e))
                await resp.write_eof()
                raise StreamFailed(resp) from e
        assert resp is not None
        thinking = thinking_tokens(
            call.parsed.reasoning_mode, events.token_ids, self.parser.think_ids
        )
        for event in events.finish(response_usage(run.usage(), thinking)):
            await resp.write(event)
        self._keep(call, events.body)
        await resp.write_eof()
        return resp

    async def get(self, request: web.Request) -> web.Response:
        if request.query.get("stream", "").lower() in ("1", "true"):
            raise bad_request("streaming a stored response is not supported", "stream")
        return web.json_response(self._stored(request).body)

    async def delete(self, request: web.Request) -> web.Response:
        response_id = self._stored(request).body["id"]
        self.store.delete(response_id)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    def _stored(self, request: web.Request) -> Any:
        response_id = request.match_info["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            message = f"Response with id '{response_id}' not found."
            raise APIError(404, message, param="response_id", code="response_not_found")
        return stored
