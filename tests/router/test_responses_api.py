"""/v1/responses (router/responses_api.py): a Responses body becomes the chat request it is
(instructions, items, tools, text.format, limits), every unservable field is a 400 naming it,
stored responses are an LRU bounded by count and bytes; and through a router with fake workers
(real ZMQ, the `openai` client): the response object, its event stream, previous_response_id,
GET / DELETE, the ignored-fields header and the overload answers chat gives."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
from router_fakes import FakeWorker, HoldingWorker

from router.config import RouterConfig
from router.errors import APIError
from router.generation import Piece
from router.response_store import ResponseStore
from router.responses_api import ResponsesAPI, chat_messages
from router.responses_output import ResponseEvents, answer_output
from router.server import request_parser

SERVED = "tiny-llama"  # tests/router/conftest.py
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def api(model_dir, model_info) -> ResponsesAPI:
    config = RouterConfig(model_path=model_dir, served_model_name=SERVED)
    return ResponsesAPI(request_parser(config, model_info), ResponseStore(8, 1 << 20))


def _error(api: ResponsesAPI, body: dict) -> APIError:
    with pytest.raises(APIError) as e:
        api.parse(json.dumps(body).encode())
    return e.value


# ------------------------------------------------------------------ conversion


def test_input_items_become_chat_messages():
    items = [
        {"type": "message", "role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": "weather?"},
        {"type": "message", "role": "assistant", "content": "checking"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    messages = chat_messages("You help.", items)
    assert [m["role"] for m in messages] == ["system", "system", "user", "assistant", "tool"]
    assert messages[0]["content"] == "You help."
    calls = messages[3]["tool_calls"]
    assert [c["id"] for c in calls] == ["c1", "c2"] and messages[3]["content"] == "checking"
    assert calls[1]["function"] == {"name": "g", "arguments": '{"a": 1}'}
    assert messages[4] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}


def test_request_runs_as_its_chat_request(api, model_info):
    tok = model_info.tokenizer
    call = api.parse(
        {
            "model": SERVED,
            "instructions": "Be short.",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi there"}]}],
            "max_output_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
            "surprise": 1,
        }
    )
    parsed = call.parsed
    expect = tok.apply_chat_template(
        [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Hi there"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert parsed.prompt_ids == tok(expect, add_special_tokens=False)["input_ids"]
    assert parsed.kind == "chat" and call.rid.startswith("resp_")
    s = parsed.sampling
    assert (s.max_tokens, s.temperature, s.top_p) == (7, 0.0, 0.5)
    assert s.structured == ("json_schema", json.dumps({"type": "object"}))
    assert parsed.ignored_fields == ["surprise"]
    forced = api.parse({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function",
                        "name": "get_weather"}}).parsed  # fmt: skip
    assert forced.sampling.structured[0] == "json_schema"
    one = api.parse({"input": "x", "tools": [WEATHER], "tool_choice": "required",
                     "parallel_tool_calls": False}).parsed  # fmt: skip
    assert not one.parallel_tool_calls and json.loads(one.sampling.structured[1])["maxItems"] == 1
    assert forced.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert forced.tools[0]["function"]["name"] == "get_weather"


def test_a_call_cut_at_the_token_limit_is_accepted_back(api, model_info):
    """An answer cut at max_output_tokens returns its call with the arguments cut; the next
    turn sends it back as it came: accepted, its text in the prompt as written."""
    cut = '{"city": "Par'
    items = [{"type": "message", "role": "user", "content": "Weather?"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": cut},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]  # fmt: skip
    parsed = api.parse({"input": items, "tools": [WEATHER]}).parsed
    prompt = model_info.tokenizer.decode(parsed.prompt_ids)
    assert "Par" in prompt and "sunny" in prompt


def test_vllm_sampling_fields_reach_the_chat_request(api):
    """Benchmark clients (aiperf, guidellm) send vLLM's ignore_eos for fixed answer lengths:
    it and the other sampling fields the chat route reads are used, not named back; fields
    accepted without effect are named back when set."""
    call = api.parse({"input": "x", "ignore_eos": True, "min_tokens": 3, "top_k": 5,
                      "repetition_penalty": 1.2, "stop": ["\n"], "user": "u",
                      "stream_options": {"include_usage": True}})  # fmt: skip
    s = call.parsed.sampling
    assert (s.ignore_eos, s.min_tokens, s.top_k, s.repetition_penalty) == (True, 3, 5, 1.2)
    assert call.parsed.stop == ("\n",)
    assert call.parsed.ignored_fields == ["stream_options", "user"]
    e = _error(api, {"input": "x", "top_k": -5})
    assert (e.status, e.param) == (400, "top_k")


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
        ({"input": "x", "background": True}, "background", "background"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "web_search"),
        ({"input": "x", "tools": [WEATHER, WEATHER]}, "tools", "twice"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"input": [{"content": "no role"}]}, "input", "message"),
        ({"input": [{"type": "image_generation_call"}]}, "input", "function_call"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input", "input_text"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "o"}]},
         "input", "nope"),
        ({"input": ""}, "input", "empty"),
        ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens", "'max_output_tokens'"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text", "schema"),
        ({"input": "x", "previous_response_id": "resp_gone"}, "previous_response_id", "not found"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(api, body, param, words):
    e = _error(api, body)
    assert (e.status, e.param) == (400, param), e.message
    assert words in e.message, e.message
    if param == "previous_response_id":
        assert e.code == "previous_response_not_found"


def test_unknown_model_is_404(api):
    assert _error(api, {"model": "other", "input": "x"}).status == 404


def test_store_evicts_least_recently_used_by_count_and_bytes():
    store = ResponseStore(max_responses=2, max_bytes=400)
    item = [{"type": "message", "role": "user", "content": "x" * 50}]
    assert store.put("a", {"id": "a"}, item) and store.put("b", {"id": "b"}, item)
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", {"id": "c"}, item)
    assert "b" not in store and "a" in store and "c" in store
    assert not store.put("huge", {"id": "huge"}, [{"content": "y" * 500}])
    big = [{"type": "message", "role": "user", "content": "z" * 250}]
    store.put("d", {"id": "d"}, big)  # over the bytes with a or c beside it
    assert list(store._entries) == ["d"] and store.nbytes <= 400
    assert store.delete("d") and not store.delete("d") and store.nbytes == 0
    assert not ResponseStore(0, 1 << 20).put("a", {}, [])


# ------------------------------------------------------------------ through a router


def test_create_retrieve_continue_delete(make_router):
    h = make_router()
    client = h.openai()
    first = client.responses.create(
        model=SERVED, input="Hello there", max_output_tokens=4, metadata={"k": "v"}
    )
    assert first.object == "response" and first.id.startswith("resp_")
    # The echo worker always stops at the token limit.
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    message = first.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert first.output_text == message.content[0].text != ""
    assert (first.usage.output_tokens, first.max_output_tokens) == (4, 4)
    assert first.usage.total_tokens == first.usage.input_tokens + 4
    assert first.metadata == {"k": "v"} and first.store is True
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(
        model=SERVED, input="And then?", previous_response_id=first.id, max_output_tokens=2
    )
    # The second prompt holds the first exchange: more input than the first prompt had.
    assert second.usage.input_tokens > first.usage.input_tokens + 2
    assert second.previous_response_id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=SERVED, input="x", previous_response_id=first.id)
    assert e.value.body["code"] == "previous_response_not_found"
    unstored = client.responses.create(model=SERVED, input="x", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_stream_events(make_router):
    h = make_router()
    client = h.openai()
    whole = client.responses.create(model=SERVED, input="Stream me", max_output_tokens=5)
    events = list(
        client.responses.create(model=SERVED, input="Stream me", max_output_tokens=5, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == 5
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    # A streamed response is stored too.
    assert client.responses.retrieve(final.id).output_text == whole.output_text


def test_ignored_fields_header_and_raw_errors(make_router):
    h = make_router()
    client = h.openai()
    raw = client.responses.with_raw_response.create(
        model=SERVED, input="hi", max_output_tokens=1, extra_body={"zany": 1}
    )
    assert raw.headers["X-Tandem-Ignored-Fields"] == "zany"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=SERVED, input="hi", tools=[{"type": "file_search"}])
    assert e.value.body["param"] == "tools" and "file_search" in e.value.body["message"]


def test_input_tokens_counts_the_prompt_a_response_would_run(make_router, api):
    """POST /v1/responses/input_tokens: the rendered conversation's tokens (the SDK's
    `responses.input_tokens.count`), nothing generated; a bad body is the same 400."""
    h = make_router()
    client = h.openai()
    body = {"input": "Hi there", "instructions": "Be short.", "tools": [WEATHER]}
    got = client.responses.input_tokens.count(model=SERVED, **body)
    assert got.input_tokens == len(api.parse(body).parsed.prompt_ids) > 0
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_tokens.count(model=SERVED, input="x", previous_response_id="nope")
    assert e.value.body["param"] == "previous_response_id"


def test_full_queue_is_429_with_retry_after(make_router):
    worker = HoldingWorker("d0")
    h = make_router(workers=[worker], max_queued_requests=0, max_queued_prompt_tokens=1)
    client = h.openai()
    held = threading.Thread(
        target=client.responses.create,
        kwargs={"model": SERVED, "input": "first one", "max_output_tokens": 1},
    )
    held.start()
    try:
        deadline = time.monotonic() + 5
        while h.server.admission.queued_requests == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as e:
            client.responses.create(model=SERVED, input="second", max_output_tokens=1)
        assert e.value.body["code"] == "queue_full"
        assert 1 <= int(e.value.response.headers["Retry-After"]) <= 60
    finally:
        worker.release()
        held.join(10)


def _events(raw: list[bytes]) -> list[dict]:
    out = []
    for event in raw:
        head, data = event.decode().strip().split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == "event: " + payload["type"]
        out.append(payload)
    return out


def test_auto_tool_calls_stream_as_function_call_items(api):
    """Hermes call text the model chose to write: held back while streamed, then one
    function_call item, the same items a whole answer has (ids aside)."""
    call = api.parse({"input": "weather?", "tools": [WEATHER]})
    assert call.parsed.tool_format == "hermes"
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    pieces = [text[:9], text[9:30], text[30:] + "\n</tool_call>"]
    events = ResponseEvents(call)
    raw = events.start()
    for i, t in enumerate(pieces):
        raw += events.piece(Piece(t, 1, finish_reason="stop" if i == 2 else None))
    raw += events.finish({"input_tokens": 1})
    payloads = _events(raw)
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    deltas = "".join(p["delta"] for p in payloads if p["type"] == "response.output_text.delta")
    assert deltas == "Let me check."
    done = [p for p in payloads if p["type"] == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0]["arguments"]) == {"city": "Paris"}
    final = payloads[-1]
    assert final["type"] == "response.completed" and final["response"] == events.body
    status, whole = answer_output(call.parsed, text + "\n</tool_call>", "stop")
    strip = ("id", "call_id")
    assert status == "completed"
    assert [{k: v for k, v in i.items() if k not in strip} for i in events.body["output"]] == [
        {k: v for k, v in i.items() if k not in strip} for i in whole
    ]
    assert [i["type"] for i in whole] == ["message", "function_call"]


def test_stream_failure_after_start_is_an_error_event(make_router):
    h = make_router(workers=[FakeWorker("d0", "colocated", mode="error", chunk=1)])
    client = h.openai()
    events = list(
        client.responses.create(model=SERVED, input="fail me", max_output_tokens=8, stream=True)
    )
    assert events[0].type == "response.created" and events[-1].type == "error"
    assert events[-1].message and events[-1].sequence_number == len(events) - 1
