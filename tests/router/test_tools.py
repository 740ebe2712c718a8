"""router/tools.py: tool validation, forced-call schemas, the hermes / llama3_json parsers (one
shot and streamed at every split point), and the tiny models' tool-aware chat template."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.tool_stream import ToolStreamParser
from router.tools import (
    ParsedToolOutput,
    detect_tool_format,
    parse_tool_calls,
    tool_choice_constraint,
    validate_tools,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["c", "f"]},
                "where": {"$ref": "#/$defs/place"},
            },
            "required": ["city"],
            "$defs": {"place": {"type": "object", "properties": {"lat": {"type": "number"}}}},
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: takes none
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {"q": {"type": "string"}, "where": {"$ref": "#/$defs/place"}},
            "required": ["q"],
            "$defs": {"place": {"type": "object", "properties": {"lat": {"type": "number"}}}},
        },
        "strict": True,
    },
}
TOOLS = [WEATHER, TIME, SEARCH]


def _calls(out: ParsedToolOutput) -> list[tuple[str, dict]]:
    for call in out.tool_calls:
        assert call["type"] == "function"
        assert call["id"].startswith("call_") and len(call["id"]) > 10
        assert isinstance(call["function"]["arguments"], str)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.tool_calls]


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("choice", [None, "none", "auto", "required"])
def test_valid_tools_pass(choice):
    validate_tools(TOOLS, choice)
    validate_tools(TOOLS, {"type": "function", "function": {"name": "search"}})


@pytest.mark.parametrize(
    ("tools", "choice", "path"),
    [
        ({"type": "function"}, None, "tools must be a list"),
        (["get_weather"], None, "tools[0] must be an object"),
        ([{"type": "retrieval"}], None, "tools[0].type"),
        ([{"type": "function", "function": "f"}], None, "tools[0].function must be an object"),
        ([WEATHER, {"type": "function", "function": {}}], None, "tools[1].function.name"),
        ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
        ([WEATHER, WEATHER], None, "tools[1].function.name 'get_weather' is defined twice"),
        (
            [{"type": "function", "function": {"name": "f", "description": 3}}],
            None,
            "tools[0].function.description",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            None,
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            None,
            "tools[0].function.parameters.type",
        ),
        (
            [{"type": "function", "function": {"name": "f", "strict": "yes"}}],
            None,
            "tools[0].function.strict",
        ),
        (TOOLS, "always", "tool_choice must be one of"),
        (TOOLS, 3, "tool_choice must be a string or an object"),
        (TOOLS, {"type": "tool", "function": {"name": "f"}}, "tool_choice.type"),
        (TOOLS, {"type": "function"}, "tool_choice.function.name must be a string"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
        ([], "required", "tool_choice 'required' needs at least one tool"),
    ],
)
def test_invalid_tools_name_the_field(tools, choice, path):
    with pytest.raises(ValueError) as err:
        validate_tools(tools, choice)
    assert path in str(err.value)
    # The request parser picks the 400's `param` by this: tool errors never say tool_choice.
    assert ("tool_choice" in str(err.value)) == path.startswith("tool_choice")


# ------------------------------------------------------------------ forced-call schemas


@pytest.mark.parametrize("choice", [None, "none", "auto"])
def test_free_choices_have_no_constraint(choice):
    assert tool_choice_constraint(TOOLS, choice) is None
    assert tool_choice_constraint(None, "required") is None


def test_required_schema_accepts_calls_of_the_tools_only():
    kind, spec = tool_choice_constraint(TOOLS, "required")
    assert kind == "json_schema"
    schema = json.loads(spec)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [
        [{"name": "get_weather", "parameters": {"city": "Paris", "where": {"lat": 48.8}}}],
        [{"name": "get_time", "parameters": {}}, {"name": "search", "parameters": {"q": "x"}}],
    ]
    bad = [
        [],  # minItems 1: "required" means at least one call
        {"name": "get_time", "parameters": {}},  # not an array
        [{"name": "get_weather", "parameters": {}}],  # city is required
        [{"name": "get_weather", "parameters": {"city": 3}}],
        [{"name": "get_weather", "parameters": {"city": "x", "where": {"lat": "north"}}}],
        [{"name": "send_mail", "parameters": {}}],  # not a tool
        [{"name": "get_time", "parameters": {"extra": 1}}],  # get_time takes nothing
        [{"name": "get_time"}],
        [{"name": "get_time", "parameters": {}, "id": 1}],
    ]
    for value in good:
        jsonschema.validate(value, schema)
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)


def test_required_schema_compiles_in_the_engine():
    from engine.structured import validate

    validate(*tool_choice_constraint(TOOLS, "required"))


def test_conflicting_defs_are_refused():
    other = json.loads(json.dumps(SEARCH))
    other["function"]["parameters"]["$defs"]["place"] = {"type": "string"}
    with pytest.raises(ValueError, match=r"tools\[1\].function.parameters.\$defs.place"):
        tool_choice_constraint([WEATHER, other], "required")


def test_named_choice_forces_that_functions_arguments():
    choice = {"type": "function", "function": {"name": "search"}}
    kind, spec = tool_choice_constraint(TOOLS, choice)
    schema = json.loads(spec)
    assert kind == "json_schema"
    jsonschema.validate({"q": "tandem"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"query": "tandem"}, schema)
    empty = json.loads(
        tool_choice_constraint(TOOLS, {"type": "function", "function": TIME["function"]})[1]
    )
    jsonschema.validate({}, empty)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"a": 1}, empty)


# ------------------------------------------------------------------ parsers

HERMES_CASES = [
    # (text, content, calls)
    ("The weather is fine.", "The weather is fine.", []),
    ("", None, []),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "Let me look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "search", "arguments": {"q": "é <b>"}}\n</tool_call>',
        "Let me look.",
        [("get_weather", {"city": "Paris"}), ("search", {"q": "é <b>"})],
    ),
    (  # stopped at EOS right after the JSON: the last tag unclosed
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n',
        None,
        [("get_time", {})],
    ),
    (  # arguments as JSON text, and text after the calls
        '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>\nDone.',
        "Done.",
        [("search", {"q": "x"})],
    ),
    (
        'Hi <tool_call>{"name": "get_time"}</tool_call> and <tool_call>{"name": "get_time"}',
        "Hi\nand",
        [("get_time", {}), ("get_time", {})],
    ),
    # Malformed: the whole text is content.
    ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',) * 2 + ([],),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>',) * 2 + ([],),
    ('<tool_call>["get_time"]</tool_call>',) * 2 + ([],),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',) * 2 + ([],),
    ("a < b and <tool_ is not a call", "a < b and <tool_ is not a call", []),
]

LLAMA_CASES = [
    ("Paris is sunny.", "Paris is sunny.", []),
    ("", None, []),
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        '<|python_tag|>{"name": "get_time", "parameters": {}}; '
        '{"name": "search", "arguments": {"q": "x"}}',
        None,
        [("get_time", {}), ("search", {"q": "x"})],
    ),
    ('\n {"name": "get_time", "parameters": {}}\n', None, [("get_time", {})]),
    # Not calls: JSON answers, code after the python tag, broken JSON, trailing junk.
    ('{"answer": 42}',) * 2 + ([],),
    ("<|python_tag|>print(1)",) * 2 + ([],),
    ('{"name": "get_time", "parameters": {',) * 2 + ([],),
    ('{"name": "get_time", "parameters": {}} and more',) * 2 + ([],),
    ('{"name": "get_time", "parameters": {}};',) * 2 + ([],),
    ('I\'d call {"name": "get_time"} here',) * 2 + ([],),
    ("<|python", "<|python", []),
]

MISTRAL_CASES = [
    ("Paris is sunny.", "Paris is sunny.", []),
    (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (  # several calls, an id the model copied from its training, and prose before them
        'Let me check. [TOOL_CALLS][{"name": "get_time", "arguments": {}, "id": "a1b2c3d4e"}, '
        '{"name": "search", "arguments": {"q": "x"}}]',
        "Let me check.",
        [("get_time", {}), ("search", {"q": "x"})],
    ),
    ('[TOOL_CALLS] {"name": "get_time", "arguments": {}}\n', None, [("get_time", {})]),
    # Not calls: broken JSON, trailing junk, no name, an empty list: all content.
    ('[TOOL_CALLS] [{"name": "get_time", "arguments": {',) * 2 + ([],),
    ('[TOOL_CALLS] [{"name": "get_time", "arguments": {}}] and more',) * 2 + ([],),
    ('[TOOL_CALLS] [{"arguments": {}}]',) * 2 + ([],),
    ("[TOOL_CALLS] []",) * 2 + ([],),
    ("[TOOL_ is not a call", "[TOOL_ is not a call", []),
]
ALL_CASES = (
    [("hermes", *c) for c in HERMES_CASES]
    + [("llama3_json", *c) for c in LLAMA_CASES]
    + [("mistral", *c) for c in MISTRAL_CASES]
)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), ALL_CASES)
def test_parse_tool_calls(fmt, text, content, calls):
    out = parse_tool_calls(text, fmt)
    assert out.content == content
    assert _calls(out) == calls


@pytest.mark.parametrize("fmt", [None, "unknown"])
def test_no_format_means_plain_content(fmt):
    text = '<tool_call>{"name": "get_time"}</tool_call>'
    assert parse_tool_calls(text, fmt) == ParsedToolOutput(text, [])
    parser = ToolStreamParser(fmt)
    assert parser.feed(text) == text
    assert parser.finish() == ParsedToolOutput(None, [])


def _stream(fmt: str, pieces: list[str]) -> tuple[str, ParsedToolOutput]:
    parser = ToolStreamParser(fmt)
    sent = "".join(parser.feed(p) for p in pieces)
    return sent, parser.finish()


@pytest.mark.parametrize(("fmt", "text"), [c[:2] for c in ALL_CASES])
def test_streamed_pieces_add_up_to_the_one_shot_result(fmt, text):
    whole = parse_tool_calls(text, fmt)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    splits += [[text[:i], text[i:j], text[j:]] for i in range(0, len(text), 7) for j in (i + 3,)]
    splits.append(list(text))  # one character at a time
    for pieces in splits:
        sent, rest = _stream(fmt, pieces)
        assert sent + (rest.content or "") == (whole.content or ""), pieces
        assert _calls(rest) == _calls(whole), pieces


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    "<",
    "<|python_tag|>",
    "<|py",
    "[TOOL_CALLS]",
    "[TOOL_",
    "[",
    "]",
    '{"name": "search", "arguments": {"q": "x"}}',
    "\n",
    "  ",
    "Hi",
    " there.",
    '{"name": "get_time", "arguments": {}}',
    '{"name": "search", "parameters": {"q": "x"}}',
    '{"name": ',
    "{",
    "}",
    ";",
    '"',
]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    fmt=st.sampled_from(["hermes", "llama3_json", "mistral"]),
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=8),
    cuts=st.lists(st.integers(0, 200), max_size=6),
)
def test_streaming_matches_one_shot_on_fragment_soup(fmt, parts, cuts):
    text = "".join(parts)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    whole = parse_tool_calls(text, fmt)
    sent, rest = _stream(fmt, pieces)
    assert sent + (rest.content or "") == (whole.content or "")
    assert _calls(rest) == _calls(whole)


def test_stream_holds_back_a_partial_marker():
    parser = ToolStreamParser("hermes")
    assert parser.feed("Checking") == "Checking"
    assert parser.feed(" now.\n<tool_") == " now."
    assert not parser.in_tool_calls
    assert parser.feed('call>\n{"name": "get_time", "arguments": {}}') == ""
    assert parser.in_tool_calls
    assert parser.feed("\n</tool_call>") == ""
    out = parser.finish()
    assert out.content is None and _calls(out) == [("get_time", {})]


def test_stream_releases_text_that_turned_out_not_to_be_a_marker():
    parser = ToolStreamParser("hermes")
    assert parser.feed("if a <") == "if a"
    assert parser.feed(" b then") == " < b then"
    assert parser.finish() == ParsedToolOutput(None, [])


def test_llama3_stream_sends_prose_at_once_and_holds_calls():
    prose = ToolStreamParser("llama3_json")
    assert prose.feed("  ") == ""
    assert prose.feed("Paris") == "  Paris"
    assert prose.feed(' {"name": "x"}') == ' {"name": "x"}'  # calls only open the output
    calls = ToolStreamParser("llama3_json")
    assert calls.feed("<|python") == ""
    assert calls.feed('_tag|>{"name": "get_time", "parameters": {}}') == ""
    assert _calls(calls.finish()) == [("get_time", {})]


# ------------------------------------------------------------------ formats and template


def test_detect_tool_format():
    assert detect_tool_format(None) is None
    assert detect_tool_format("{{ messages }}") is None
    assert detect_tool_format('... <tool_call>\\n{"name": ...') == "hermes"
    assert detect_tool_format("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    llama32 = 'Respond in the format {"name": function name, "parameters": dictionary of argument'
    assert detect_tool_format(llama32) == "llama3_json"
    assert detect_tool_format({"default": "x", "tool_use": "<tool_call>"}) == "hermes"
    assert detect_tool_format("{{- '[TOOL_CALLS] [' }}") == "mistral"


def test_mistral_call_ids_are_nine_characters_and_map_alike():
    from router.tools import mistral_call_id, with_mistral_call_ids

    assert mistral_call_id("a1b2c3d4e", "0") == "a1b2c3d4e"  # already Mistral's shape
    ids = {mistral_call_id(f"call_{i}", "0") for i in range(200)}
    assert len(ids) == 200 and all(len(i) == 9 and i.isalnum() for i in ids)
    messages = with_mistral_call_ids([
        {"role": "assistant", "tool_calls": [{"id": "call_x", "function": {}}, {"function": {}}]},
        {"role": "tool", "tool_call_id": "call_x", "content": "1"},
    ])  # fmt: skip
    call_id = messages[0]["tool_calls"][0]["id"]
    assert messages[1]["tool_call_id"] == call_id and len(call_id) == 9
    assert len(messages[0]["tool_calls"][1]["id"]) == 9  # a legacy function_call has none


@pytest.fixture(scope="module")
def tokenizer():
    from tools.make_model import build_tokenizer

    return build_tokenizer(1024, 1024)


# The template before tools were added: prompts without tools must not change.
_PLAIN_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Sunny."},
    {"role": "user", "content": "And Rome?"},
]


def test_template_without_tools_is_unchanged(tokenizer):
    from tools.make_model import CHAT_TEMPLATE

    for messages in (CHAT, CHAT[1:], CHAT[1:2]):
        for gen in (True, False):
            new = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen, chat_template=CHAT_TEMPLATE
            )
            old = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen, chat_template=_PLAIN_TEMPLATE
            )
            assert new == old
    assert detect_tool_format(CHAT_TEMPLATE) == "hermes"


def test_template_renders_tools_calls_and_results_qwen_style(tokenizer):
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {}}},
        {"id": "c2", "type": "function", "function": {"name": "search", "arguments": '{"q": 1}'}},
    ]
    messages = [
        *CHAT[:2],
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "found"},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=[WEATHER, SEARCH], tokenize=False, add_generation_prompt=True
    )
    system, tools_json = text.split("<tools>\n", 1)
    assert system == "<|bos|><|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or " + (
        "more functions to assist with the user query.\n\nYou are provided with function "
        "signatures within <tools></tools> XML tags:\n"
    )
    listed = tools_json.split("\n</tools>", 1)[0].split("\n")
    assert [json.loads(line) for line in listed] == [WEATHER, SEARCH]
    turns = text.split("<|eos|>\n")
    assert turns[1] == "<|im_start|>user\nWeather in Paris?"
    assert turns[2] == (
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {}}\n</tool_call>\n<tool_call>\n'
        '{"name": "search", "arguments": {"q": 1}}\n</tool_call>'
    )
    assert turns[3] == (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nfound\n</tool_response>"
    )
    assert turns[4] == "<|im_start|>assistant\n"
    # What the model is shown is what the parser reads back.
    assert _calls(parse_tool_calls(turns[2].split("assistant\n", 1)[1], "hermes")) == [
        ("get_weather", {}),
        ("search", {"q": 1}),
    ]
