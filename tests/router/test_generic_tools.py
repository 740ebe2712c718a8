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
from router.tool_stream import ForcedCallParser
from router.tools import tool_choice_constraint

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


def _accepts(compiled, tokenizer, text: str) -> bool:
    matcher = compiled.matcher()
    eos = compiled.eos_token_ids
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.accept_tokens(ids) and matcher.accept(next(iter(eos)))


def test_auto_answers_are_constrained_to_text_or_calls_the_parser_reads(parser):
    """The "auto" grammar: prose that never opens a call, or only `<tool_call>` blocks naming
    a tool with arguments valid for its schema; one block when parallel_tool_calls is false."""
    from engine.structured.compiler import GrammarCompiler

    tok = parser.tokenizer
    compiler = GrammarCompiler(tok, len(tok), (tok.eos_token_id,))
    zone = {**TIME["function"]["parameters"], "required": ["zone"]}
    tool = {"type": "function", "function": {**TIME["function"], "parameters": zone}}
    call = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'
    good, two = (
        call.format("get_time", '{"zone": "UTC"}'),
        "\n".join([call.format("get_time", '{"zone": "UTC"}')] * 2),
    )
    for parallel, two_ok in ((None, True), (False, False)):
        body = {"messages": LOOP[:1], "tools": [tool], "parallel_tool_calls": parallel}
        kind, spec = parser.parse_chat(body).sampling.structured
        assert kind == "grammar"
        grammar = compiler.compile(kind, spec)
        assert _accepts(grammar, tok, "It is noon.") and _accepts(grammar, tok, good)
        assert _accepts(grammar, tok, two) is two_ok
        for bad in (call.format("get_date", '{"zone": "UTC"}'), call.format("get_time", "{}"),
                    "Sure. " + good):  # fmt: skip
            assert not _accepts(grammar, tok, bad), bad
    # A constraint the client asked for wins; "none" and forced calls keep theirs.
    body = {"messages": LOOP[:1], "tools": [tool], "response_format": {"type": "json_object"}}
    assert parser.parse_chat(body).sampling.structured[0] == "json_object"
    body = {"messages": LOOP[:1], "tools": [tool], "tool_choice": "none"}
    assert parser.parse_chat(body).sampling.structured is None


def _stream(parsed, pieces: list[str], finish: str) -> list[dict]:
    """The tool-call deltas StreamWriter sends for `pieces` of one answer."""
    from types import SimpleNamespace

    from router.generation import Piece
    from router.serving import StreamWriter

    run = SimpleNamespace(parsed=parsed, rid="chatcmpl-1", tokenizer=None, text_of=None)
    writer, out = StreamWriter(run, 1_700_000_000), []
    for i, text in enumerate(pieces):
        last = finish if i == len(pieces) - 1 else None
        for chunk in writer.chunks(0, Piece(text, 1, last, 0, [5])):
            out.append(chunk["choices"][0])
    return out


@pytest.mark.parametrize("cut", [False, True])
def test_auto_calls_stream_their_arguments_and_a_cut_one_is_returned(parser, cut):
    """Under the auto grammar a call streams like a forced one (id and name first, then the
    arguments in fragments); cut by max_tokens it is still a call, with its arguments so far,
    streamed and whole alike (finish_reason "length")."""
    parsed = parser.parse_chat({"messages": LOOP[:1], "tools": [TIME]})
    assert parsed.tool_grammar
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>'
    if cut:
        text = text[: text.index("Paris")]
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
    choices = _stream(parsed, pieces, "length" if cut else "stop")
    deltas = [d for c in choices for d in c["delta"].get("tool_calls") or []]
    assert deltas[0]["function"] == {"name": "get_time", "arguments": ""} and deltas[0]["id"]
    fragments = [d["function"]["arguments"] for d in deltas[1:]]
    assert len(fragments) > 2  # arguments arrive as they are generated, not in one piece
    args = "".join(fragments)
    assert args == ('{"zone": "Europe/' if cut else '{"zone": "Europe/Paris"}')
    assert not any(c["delta"].get("content") for c in choices)
    assert choices[-1]["finish_reason"] == ("length" if cut else "tool_calls")
    message, called = tool_message(parsed, text)
    assert called and message["content"] is None
    assert message["tool_calls"][0]["function"]["arguments"] == args


def test_llama3_json_auto_answers_are_constrained_and_streamed():
    """The same for a template in Llama 3.x's JSON format: {"name", "parameters"} objects
    joined by "; ", or text that does not begin with "{"; a call streams its arguments."""
    from engine.structured.compiler import GrammarCompiler
    from tools.make_model import build_tokenizer

    tok = build_tokenizer(1024, 1024)
    tok.chat_template = PLAIN
    llama = RequestParser(tok, "m", 1024, len(tok), tool_format="llama3_json")
    compiler = GrammarCompiler(tok, len(tok), (tok.eos_token_id,))
    call = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
    for parallel, two_ok in ((None, True), (False, False)):
        body = {"messages": LOOP[:1], "tools": [TIME], "parallel_tool_calls": parallel}
        parsed = llama.parse_chat(body)
        assert parsed.tool_grammar and parsed.tool_format == "llama3_json"
        grammar = compiler.compile(*parsed.sampling.structured)
        assert _accepts(grammar, tok, "It is noon.") and _accepts(grammar, tok, call)
        assert _accepts(grammar, tok, f"{call}; {call}") is two_ok
        for bad in ('{"zone": "UTC"}', '{"name": "get_date", "parameters": {}}', ' {"a": 1}'):
            assert not _accepts(grammar, tok, bad), bad
    parsed = llama.parse_chat({"messages": LOOP[:1], "tools": [TIME]})
    choices = _stream(parsed, [call[i : i + 5] for i in range(0, len(call), 5)], "stop")
    deltas = [d for c in choices for d in c["delta"].get("tool_calls") or []]
    assert deltas[0]["function"]["name"] == "get_time"
    assert "".join(d["function"]["arguments"] for d in deltas[1:]) == '{"zone": "UTC"}'
    assert choices[-1]["finish_reason"] == "tool_calls"
    message, called = tool_message(parsed, call)
    assert called and message["tool_calls"][0]["function"]["arguments"] == '{"zone": "UTC"}'
