"""/v1/responses through a live `tandem serve` (colocated, fp32, one server for the module),
driven by the `openai` client and parsed with its own types: a plain response, the same answer
streamed as Responses events (greedy, so the texts must match), a forced function call and its
round trip (the output items sent back with a function_call_output, and the same through
previous_response_id), text.format json_schema, the 400s OpenAI gives, and the LRU bound
(--responses-max-stored 4) evicting the oldest response."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage

MAX_STORED = 4
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
FORCE = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def server(start_serve, e2e_model):
    flags = ("--dtype", "float32", "--mode", "colocated", "--responses-max-stored", str(MAX_STORED))
    with start_serve(e2e_model, *flags) as sp:
        yield sp


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_plain_and_streamed_greedy_agree(client, model):
    kwargs = {"model": model, "input": "Tell me about the weather.", "temperature": 0,
              "max_output_tokens": 12, "instructions": "Answer briefly."}  # fmt: skip
    whole = client.responses.create(**kwargs)
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    message = whole.output[0]
    assert isinstance(message, ResponseOutputMessage) and message.role == "assistant"
    assert whole.output_text and 0 < whole.usage.output_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert whole.instructions == "Answer briefly." and whole.temperature == 0
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_forced_function_call_round_trip(client, model):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.responses.create(
        model=model, input=[question], tools=[WEATHER], tool_choice=FORCE, max_output_tokens=48,
        temperature=0,
    )  # fmt: skip
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and isinstance(calls[0], ResponseFunctionToolCall)
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert first.tool_choice.name == "get_weather" and first.tools[0].name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    # The client's own pattern: the output items sent back, then the call's result.
    second = client.responses.create(
        model=model, input=[question, *first.output, result], tools=[WEATHER],
        max_output_tokens=4, temperature=0,
    )  # fmt: skip
    assert second.output[0].type == "message"
    assert second.usage.input_tokens > first.usage.input_tokens
    # The same conversation from the stored response: the same prompt.
    chained = client.responses.create(
        model=model, input=[result], previous_response_id=first.id, tools=[WEATHER],
        max_output_tokens=4, temperature=0,
    )  # fmt: skip
    assert chained.usage.input_tokens == second.usage.input_tokens
    assert chained.output_text == second.output_text
    streamed = list(client.responses.create(
        model=model, input=[question], tools=[WEATHER], tool_choice=FORCE, max_output_tokens=48,
        temperature=0, stream=True,
    ))  # fmt: skip
    args = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert len(args) == 1 and args[0].arguments == call.arguments


def test_text_format_json_schema(client, model):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "name": "place", "schema": schema, "strict": True}
    r = client.responses.create(
        model=model, input="Name a city.", text={"format": fmt}, max_output_tokens=48
    )
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "place"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"tools": [{"type": "web_search_preview"}]}, "tools"),
        ({"input": [{"type": "message", "content": "no role"}]}, "input"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
    ],
)
def test_bad_requests_get_openai_errors(client, model, extra, param):
    body = {"model": model, "input": "hi", "max_output_tokens": 1} | extra
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    if param == "previous_response_id":
        assert e.value.body["code"] == "previous_response_not_found"


def test_store_bound_evicts_the_oldest(client, model):
    ids = [
        client.responses.create(model=model, input=f"note {i}", max_output_tokens=1).id
        for i in range(MAX_STORED + 1)
    ]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="x", previous_response_id=ids[0])
    assert e.value.body["code"] == "previous_response_not_found"
    assert client.responses.retrieve(ids[-1]).id == ids[-1]
