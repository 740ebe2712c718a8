"""Tools on a model whose chat template has no tool-call format (router/generic_tools.py):
`tool_choice` "auto" (OpenAI's default when tools come alone) is served, not refused; the tools
are described in the prompt, a tool loop's earlier calls and results are written in the format
the prompt asks for, and what the model writes in it comes back as `tool_calls`. Also
`parallel_tool_calls: false` for "auto" (one call returned) and forced calls cut by the length
limit (router/tools.py ForcedCallParser)."""

from __future__ import annotations

import json

import pytest

from router.generic_tools import messages_with_tools
from router.openai_api import RequestParser
from router.responses import tool_message
from router.tools import ForcedCallParser, tool_choice_constraint

# A ChatML template with no tool support at all (it drops `tools` and `tool_calls`).
PLAIN = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}
CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'},
}
LOOP = [
    {"role": "user", "content": "What time is it?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    {"role": "user", "content": "Thanks. And in Tokyo?"},
]


@pytest.fixture(scope="module")
def parser():
    from tools.make_model import build_tokenizer

    tok = build_tokenizer(1024, 1024)
    tok.chat_template = PLAIN
    return RequestParser(tok, "m", 1024, len(tok), tool_format=None)


def _prompt(parser, parsed) -> str:
    return parser.tokenizer.decode(parsed.prompt_ids, skip_special_tokens=False)


def test_tools_without_tool_choice_are_served_on_a_template_without_tools(parser):
    parsed = parser.parse_chat({"messages": LOOP[:1], "tools": [TIME]})
    assert parsed.tool_choice == "auto" and parsed.tool_format == "hermes"
    text = _prompt(parser, parsed)
    assert "<tools>" in text and '"name": "get_time"' in text and "<tool_call>" in text
    # The model's answer in the declared format is a tool call; prose stays prose.
    message, called = tool_message(
        parsed, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    )
    assert called and message["tool_calls"][0]["function"]["name"] == "get_time"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"zone": "UTC"}
    assert tool_message(parsed, "It is noon.") == (
        {"role": "assistant", "content": "It is noon."},
        False,
    )


def test_a_tool_loop_renders_its_calls_and_results(parser):
    parsed = parser.parse_chat({"messages": LOOP, "tools": [TIME]})
    text = _prompt(parser, parsed)
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>' in text
    # The result and the next question are one user turn (no two user turns in a row).
    assert "<tool_response>\n12:00\n</tool_response>\nThanks. And in Tokyo?" in text
    assert text.count("<|im_start|>user") == 2


def test_messages_with_tools_keeps_a_system_message_first():
    out = messages_with_tools([{"role": "system", "content": "Be brief."}, *LOOP[:1]], [TIME])
    assert [m["role"] for m in out] == ["system", "user"]
    assert out[0]["content"].startswith("Be brief.\n\nYou can call functions")


def test_parallel_tool_calls_false_returns_one_call(parser):
    two = "\n".join(
        f'<tool_call>\n{{"name": "get_time", "arguments": {{"zone": "{z}"}}}}\n</tool_call>'
        for z in ("UTC", "CET")
    )
    for parallel, n in ((None, 2), (False, 1)):
        body = {"messages": LOOP[:1], "tools": [TIME], "parallel_tool_calls": parallel}
        message, _ = tool_message(parser.parse_chat(body), two)
        assert len(message["tool_calls"]) == n
    schema = json.loads(tool_choice_constraint([TIME], "required", parallel=False)[1])
    assert schema["maxItems"] == 1 and schema["minItems"] == 1


REQUIRED = '[{"name": "get_time", "parameters": {"zone": "U{T}C"}}, {"name": "get_time", "parameters": {"zone": "CET"}}]'


@pytest.mark.parametrize("choice, text, args", [
    ({"type": "function", "function": {"name": "get_time"}}, '{"zone": "UTC"}', ['{"zone": "UTC"}']),
    ("required", REQUIRED, ['{"zone": "U{T}C"}', '{"zone": "CET"}']),
])  # fmt: skip
def test_forced_calls_stream_in_pieces_that_add_up(choice, text, args):
    for step in (1, 3, len(text)):
        parser = ForcedCallParser(choice)
        deltas = [d for i in range(0, len(text), step) for d in parser.feed(text[i : i + step])]
        heads = [d for d in deltas if "id" in d]
        assert [(d["index"], d["function"]["arguments"]) for d in heads] == [
            (i, "") for i in range(len(args))
        ]
        joined = [
            "".join(d["function"]["arguments"] for d in deltas if d["index"] == i)
            for i in range(len(args))
        ]
        assert joined == args == [c["function"]["arguments"] for c in parser.calls()]


def test_a_forced_call_cut_short_keeps_its_arguments_so_far():
    parser = ForcedCallParser("required")
    parser.feed(REQUIRED[: REQUIRED.index("CET") + 1])  # inside the second call's arguments
    calls = parser.calls()
    assert [c["function"]["arguments"] for c in calls] == ['{"zone": "U{T}C"}', '{"zone": "C']
    named = ForcedCallParser({"type": "function", "function": {"name": "get_time"}})
    named.feed('{"zo')
    assert named.calls()[0]["function"] == {"name": "get_time", "arguments": '{"zo'}
