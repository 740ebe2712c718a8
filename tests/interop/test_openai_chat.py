"""The `openai` client's /v1/chat/completions against a live `tandem serve` (1 prefill + 1
decode, fp32): logprobs against transformers, n, structured outputs (the tiny model is random,
so only the grammar can make its output valid), tools, tool messages, cached-token usage; and
the errors: refused fields, bad log-prob settings, unknown fields named back in a header, an
invalid schema.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from .conftest import THRESHOLD
from .reference import TOL

USER = [{"role": "user", "content": "Weather in Paris today?"}]
SYSTEM_LONG = (
    "You are a helpful assistant who answers questions about the weather in short sentences, "
    "always names the city, and never makes up a temperature it was not given."
)
LONG = [{"role": "system", "content": SYSTEM_LONG}, *USER]
CONVERSATIONS = pytest.mark.parametrize("messages", [USER, LONG], ids=["local", "remote"])
NO_EOS = {"ignore_eos": True}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "sunny": {"type": "boolean"},
        "sky": {"type": "string", "enum": ["clear", "cloudy", "rain"]},
    },
    "required": ["city", "sunny", "sky"],
    "additionalProperties": False,
}


def test_conversations_take_both_paths(client, model_name, reference):
    assert len(reference.chat_ids(USER)) < THRESHOLD <= len(reference.chat_ids(LONG))
    for messages, path in ((USER, "local"), (LONG, "remote")):
        raw = client.chat.completions.with_raw_response.create(
            model=model_name, messages=messages, max_tokens=2
        )
        assert raw.headers["X-Tandem-Path"] == path


@CONVERSATIONS
def test_logprobs_top_3_equal_transformers(chat, reference, messages):
    steps = reference.greedy(reference.chat_ids(messages), 8)
    r = chat(
        messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
        extra_body=NO_EOS,
    )  # fmt: skip
    (choice,) = r.choices
    assert choice.message.content == reference.text([s.token for s in steps])
    content = choice.logprobs.content
    assert len(content) == len(steps)
    for entry, step in zip(content, steps, strict=True):
        assert entry.token == reference.token_str(step.token)
        assert abs(entry.logprob - step.logprob) < TOL, (entry.logprob, step.logprob)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 3
        for top, (token, lp) in zip(entry.top_logprobs, step.top(3), strict=True):
            assert top.token == reference.token_str(token)
            assert abs(top.logprob - lp) < TOL, (top.logprob, lp)
            assert top.bytes == list(top.token.encode("utf-8"))
    assert r.usage.prompt_tokens == len(reference.chat_ids(messages))


@CONVERSATIONS
def test_n2_seeded_choices_differ(chat, messages):
    r = chat(messages=messages, n=2, max_tokens=12, temperature=1.0, seed=9, extra_body=NO_EOS)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert r.usage.completion_tokens == 24


@CONVERSATIONS
@pytest.mark.parametrize("seed", [None, 1])
def test_response_format_json_object(chat, reference, messages, seed):
    """json_object bounds nothing, and the random model left alone stays inside its first
    string for hundreds of tokens; a nudge towards '"' and '}' (both are valid in many states,
    and without the grammar the model would never write an object, let alone end after it)
    lets the grammar close the object within max_tokens."""
    tok = reference.tokenizer
    bias = {str(tok.convert_tokens_to_ids('"')): 5, str(tok.convert_tokens_to_ids("}")): 2}
    sampling = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
    r = chat(
        messages=messages, max_tokens=200, response_format={"type": "json_object"},
        logit_bias=bias, **sampling,
    )  # fmt: skip
    (choice,) = r.choices
    assert choice.finish_reason == "stop", choice
    assert isinstance(json.loads(choice.message.content), dict)


@CONVERSATIONS
@pytest.mark.parametrize("seed", [None, 1, 2])
def test_response_format_json_schema(chat, messages, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    sampling = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
    r = chat(messages=messages, max_tokens=200, response_format=fmt, **sampling)
    (choice,) = r.choices
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


@CONVERSATIONS
def test_guided_regex_and_choice(chat, messages):
    pattern = r"[a-z]{3}-[0-9]{2}"
    for seed in (1, 2):
        r = chat(
            messages=messages, max_tokens=20, temperature=1.0, seed=seed,
            extra_body={"guided_regex": pattern},
        )  # fmt: skip
        assert re.fullmatch(pattern, r.choices[0].message.content), r.choices[0].message
    options = ["sunny", "cloudy", "rainy"]
    for seed in (1, 2):
        r = chat(
            messages=messages, max_tokens=20, temperature=1.0, seed=seed,
            extra_body={"guided_choice": options},
        )  # fmt: skip
        assert r.choices[0].message.content in options, r.choices[0].message


def _check_calls(message, names: set[str]) -> None:
    assert message.tool_calls, message
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in message.tool_calls:
        assert call.type == "function" and call.id
        assert call.function.name in names, call
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@CONVERSATIONS
def test_tool_choice_required(chat, messages):
    for seed in (None, 3):
        sampling = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
        r = chat(messages=messages, max_tokens=200, tools=TOOLS, tool_choice="required", **sampling)
        (choice,) = r.choices
        assert choice.finish_reason == "tool_calls", choice
        _check_calls(choice.message, {"get_weather", "get_time"})


@CONVERSATIONS
def test_tool_choice_named_function(chat, messages):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = chat(messages=messages, max_tokens=200, temperature=0, tools=TOOLS, tool_choice=named)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls", choice
    _check_calls(choice.message, {"get_time"})
    assert len(choice.message.tool_calls) == 1


@CONVERSATIONS
def test_tool_choice_auto_answers(chat, reference, messages):
    r = chat(messages=messages, max_tokens=32, temperature=0, tools=TOOLS, tool_choice="auto")
    (choice,) = r.choices
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.message.tool_calls:
        _check_calls(choice.message, {"get_weather", "get_time"})
    else:
        assert isinstance(choice.message.content, str)
    # The tools were rendered into the prompt by the chat template.
    assert r.usage.prompt_tokens == len(reference.chat_ids(messages, TOOLS))


def test_tool_messages_render_and_answer(chat, reference):
    args = {"city": "Paris", "unit": "celsius"}
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(args)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    # "none": the same prompt (the template still renders the tools) without the grammar that
    # holds an "auto" answer to text or valid calls, so the answer is transformers' greedy one
    # (this random model's greedy text is not always valid UTF-8, which the grammar refuses).
    r = chat(messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0,
             extra_body=NO_EOS)  # fmt: skip
    (choice,) = r.choices
    assert isinstance(choice.message.content, str) and choice.finish_reason == "length"
    # Rendered as the template renders the call (arguments as an object) and the tool result.
    rendered = [
        *messages[:1],
        {**messages[1], "tool_calls": [{**messages[1]["tool_calls"][0], "function": {
            "name": "get_weather", "arguments": args}}]},
        messages[2],
    ]  # fmt: skip
    ids = reference.chat_ids(rendered, TOOLS)
    assert "<tool_response>" in reference.text(ids, skip_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids)
    assert choice.message.content == reference.greedy_text(ids, 8)


def test_usage_counts_cached_prompt_tokens(chat):
    # A prompt no other test sends (not even its first block): nothing cached the first time.
    system = "Cached tokens: " + " ".join(reversed(SYSTEM_LONG.split())) * 3
    messages = [{"role": "system", "content": system}, USER[0]]
    cached = []
    for _ in range(2):
        r = chat(messages=messages, max_tokens=4, temperature=0, extra_body=NO_EOS)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0, cached
    assert 0 < cached[1] <= r.usage.prompt_tokens, cached


# ------------------------------------------------------------------ errors


def _bad_request(call, param: str) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    err = info.value
    assert err.status_code == 400
    assert err.param == param or param in str(err.message), (param, err.body)
    return err


@pytest.mark.parametrize(
    "field, value",
    [
        ("functions", [WEATHER["function"]]),
        ("function_call", {"name": "get_weather"}),
        ("spaces_between_special_tokens", False),
    ],
)
def test_refused_chat_fields_name_themselves(chat, field, value):
    _bad_request(lambda: chat(messages=USER, max_tokens=4, extra_body={field: value}), field)


def test_refused_completion_fields_name_themselves(client, model_name):
    def call(**kwargs):
        return client.completions.create(model=model_name, prompt="hi", max_tokens=4, **kwargs)

    _bad_request(lambda: call(suffix="the end"), "suffix")
    _bad_request(
        lambda: call(extra_body={"spaces_between_special_tokens": False}),
        "spaces_between_special_tokens",
    )


def test_bad_logprob_settings(chat, client, model_name):
    _bad_request(lambda: chat(messages=USER, max_tokens=4, top_logprobs=3), "top_logprobs")
    _bad_request(
        lambda: chat(messages=USER, max_tokens=4, logprobs=True, top_logprobs=21), "top_logprobs"
    )
    _bad_request(
        lambda: client.completions.create(model=model_name, prompt="hi", max_tokens=4, logprobs=21),
        "logprobs",
    )


def test_unknown_fields_are_named_in_a_header(client, model_name):
    raw = client.chat.completions.with_raw_response.create(
        model=model_name, messages=USER, max_tokens=4, extra_body={"not_a_field": 1}
    )
    assert "not_a_field" in raw.headers.get("X-Tandem-Ignored-Fields", "")
    assert raw.parse().choices[0].message.content is not None
    raw = client.completions.with_raw_response.create(
        model=model_name, prompt="hi", max_tokens=4, extra_body={"not_a_field": 1, "zzz": 2}
    )
    assert set(raw.headers.get("X-Tandem-Ignored-Fields", "").split(",")) == {"not_a_field", "zzz"}
    assert raw.parse().choices[0].text is not None
    raw = client.completions.with_raw_response.create(model=model_name, prompt="hi", max_tokens=4)
    assert "X-Tandem-Ignored-Fields" not in raw.headers


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
        {"guided_json": {"type": "not_a_type"}},
        {"guided_regex": "(unclosed"},
    ],
    ids=["response_format", "guided_json", "guided_regex"],
)  # fmt: skip
def test_invalid_structured_constraint_is_400(chat, extra):
    with pytest.raises(openai.BadRequestError) as info:
        chat(messages=USER, max_tokens=4, extra_body=extra)
    assert info.value.status_code == 400


def test_every_kv_block_returned(server):
    server.wait_all_blocks_free()


# ------------------------------------------------------------------ what agents need (issue 27)

NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def test_forced_call_cut_by_length_is_returned_as_a_call(chat):
    full = chat(messages=USER, max_tokens=200, temperature=0, tools=TOOLS,
                tool_choice=NAMED_WEATHER).choices[0]  # fmt: skip
    assert full.finish_reason == "tool_calls"
    cut = chat(messages=USER, max_tokens=4, temperature=0, tools=TOOLS,
               tool_choice=NAMED_WEATHER).choices[0]  # fmt: skip
    assert cut.finish_reason == "length", cut
    assert cut.message.content is None, cut.message  # not the partial JSON as text
    (call,) = cut.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args, whole = call.function.arguments, full.message.tool_calls[0].function.arguments
    assert args and whole.startswith(args) and len(args) < len(whole)


def test_a_cut_call_sent_back_is_accepted(chat):
    """The cut call above, sent back as the answer gave it (its arguments are not JSON), with
    the tool's result: the next turn runs (OpenAI accepts any arguments text in history)."""
    cut = chat(messages=USER, max_tokens=4, temperature=0, tools=TOOLS,
               tool_choice=NAMED_WEATHER).choices[0].message  # fmt: skip
    (call,) = cut.tool_calls
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)
    result = {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
    history = [*USER, cut.model_dump(exclude_none=True), result]
    answer = chat(messages=history, max_tokens=4, temperature=0, tools=TOOLS).choices[0]
    assert answer.finish_reason in ("length", "stop", "tool_calls"), answer


@pytest.mark.parametrize("choice", [NAMED_WEATHER, "required"], ids=["named", "required"])
def test_forced_call_arguments_stream_as_they_are_generated(client, model_name, chat, choice):
    kwargs = dict(messages=USER, max_tokens=200, temperature=0, tools=TOOLS, tool_choice=choice)
    whole = chat(**kwargs).choices[0].message.tool_calls
    stream = client.chat.completions.create(model=model_name, stream=True, **kwargs)
    deltas, finish = [], None
    for chunk in stream:
        (c,) = chunk.choices
        deltas += c.delta.tool_calls or []
        finish = c.finish_reason or finish
    assert finish == "tool_calls"
    # OpenAI's shape: per call first its id, type and name (arguments ""), then fragments.
    firsts = [d for d in deltas if d.id is not None]
    assert [(d.index, d.function.name, d.function.arguments) for d in firsts] == [
        (i, c.function.name, "") for i, c in enumerate(whole)
    ]
    streamed = ["".join(d.function.arguments or "" for d in deltas if d.index == i)
                for i in range(len(whole))]  # fmt: skip
    assert streamed == [c.function.arguments for c in whole]
    fragments = [d for d in deltas if d.id is None and d.function.arguments]
    assert len(fragments) > len(whole), "the arguments came as one piece"


def test_parallel_tool_calls_false_allows_one_call(chat):
    for seed in range(4):
        r = chat(messages=USER, max_tokens=200, temperature=1.0, seed=seed, tools=TOOLS,
                 tool_choice="required", parallel_tool_calls=False)  # fmt: skip
        assert len(r.choices[0].message.tool_calls) == 1, r.choices[0].message


def test_messages_sent_back_as_received_are_accepted(client, model_name, chat):
    first = chat(messages=USER, max_tokens=4, temperature=0).choices[0].message
    sent_back = first.model_dump()  # audio, function_call, annotations, refusal: all null
    assert {"audio", "function_call", "annotations", "refusal"} <= set(sent_back)
    messages = [*USER, sent_back, {"role": "user", "content": "And tomorrow?"}]
    raw = client.chat.completions.with_raw_response.create(
        model=model_name, messages=messages, max_tokens=4, temperature=0
    )
    assert raw.parse().choices[0].message.content is not None
    assert "X-Tandem-Ignored-Fields" not in raw.headers  # null fields ask for nothing
    # A set but unused field is named back; a legacy function_call is used as the tool call.
    legacy = {"role": "assistant", "content": None, "audio": {"id": "audio_1"},
              "function_call": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}  # fmt: skip
    raw = client.chat.completions.with_raw_response.create(
        model=model_name, messages=[*USER, legacy, {"role": "user", "content": "ok"}],
        max_tokens=4, temperature=0,
    )  # fmt: skip
    assert raw.headers["X-Tandem-Ignored-Fields"] == "messages%5B1%5D.audio"


def test_current_openai_fields_are_accepted_and_named(client, model_name):
    fields = {"store": True, "metadata": {"k": "v"}, "service_tier": "auto",
              "reasoning_effort": "low", "prompt_cache_key": "u1", "safety_identifier": "h"}  # fmt: skip
    raw = client.chat.completions.with_raw_response.create(
        model=model_name, messages=USER, max_tokens=2, modalities=["text"], **fields
    )
    assert sorted(raw.headers["X-Tandem-Ignored-Fields"].split(",")) == sorted(fields)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model_name, messages=USER, max_tokens=2, modalities=["text", "audio"]
        )
    assert e.value.body["param"] == "modalities" and "audio" not in e.value.body["param"]


def test_model_id_is_the_directory_name_and_the_path_still_works(client, model_name, interop_model):
    assert "/" not in model_name and model_name == interop_model.name
    r = client.chat.completions.create(model=str(interop_model), messages=USER, max_tokens=2)
    assert r.model == model_name
