"""OpenAI tool calling: request validation, forced-call constraints and output parsers.

- `validate_tools(tools, tool_choice)`: the OpenAI shape, or a ValueError naming the field path
  (the request parser turns it into a 400).
- `tool_choice_constraint(tools, tool_choice)`: the structured-output spec that makes the model
  call a tool ("required": a JSON array of {"name", "parameters"}, vLLM's format; a named
  function: its arguments object), or None ("auto" and "none" leave the model free).
- `parse_tool_calls(text, fmt)` / `ToolStreamParser(fmt)`: for "auto", the calls the model chose
  to write in its chat template's own format: "hermes" (Qwen2.5, Hermes: `<tool_call>` blocks)
  or "llama3_json" (Llama 3.x: `{"name", "parameters"}` objects, optionally after
  `<|python_tag|>`, separated by `;`) or "mistral" (Mistral v0.3: `[TOOL_CALLS]` then a JSON
  array of {"name", "arguments"}). Malformed call text is returned as plain content.
- `detect_tool_format(chat_template)`: which of those a model's template teaches it.

Pure functions of their inputs (no torch, no I/O), so the router imports them freely.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_FORMATS = ("hermes", "llama3_json", "mistral")
TOOL_CHOICE_MODES = ("none", "auto", "required")
# OpenAI's rule for function names.
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# Mistral's call marker: a control token of its tokenizer, so it is only in the text when
# special tokens are decoded (ParsedRequest.skip_special_tokens is False for such requests).
MISTRAL_CALLS = "[TOOL_CALLS]"
# A function declared without parameters takes none: its arguments are exactly {}.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(slots=True)
class ParsedToolOutput:
    """Model output split into message content (None when there is none) and OpenAI-shaped
    tool calls: {"id": "call_...", "type": "function", "function": {"name", "arguments"}}."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


# ------------------------------------------------------------------ request validation


def validate_tools(tools: Any, tool_choice: Any) -> None:
    """Check `tools` and `tool_choice` against OpenAI's chat API; ValueError names the path."""
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list, got {type(tools).__name__}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        name = _check_tool(tool, f"tools[{i}]")
        if name in names:
            raise ValueError(f"tools[{i}].function.name {name!r} is defined twice")
        names.add(name)
    _check_tool_choice(tool_choice, names)


def _check_tool(tool: Any, path: str) -> str:
    if not isinstance(tool, dict):
        raise ValueError(f"{path} must be an object, got {type(tool).__name__}")
    if tool.get("type") != "function":
        raise ValueError(f"{path}.type must be 'function', got {tool.get('type')!r}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ValueError(f"{path}.function must be an object")
    path = f"{path}.function"
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"{path}.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise ValueError(f"{path}.description must be a string")
    params = fn.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ValueError(f"{path}.parameters must be a JSON schema object")
        if params.get("type", "object") != "object":
            raise ValueError(f"{path}.parameters.type must be 'object', got {params['type']!r}")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise ValueError(f"{path}.strict must be a boolean")
    return name


def _check_tool_choice(choice: Any, names: set[str]) -> None:
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in TOOL_CHOICE_MODES:
            raise ValueError(f"tool_choice must be one of {TOOL_CHOICE_MODES} or an object")
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs at least one tool")
        return
    if not isinstance(choice, dict):
        raise ValueError(f"tool_choice must be a string or an object, not {type(choice).__name__}")
    if choice.get("type") != "function":
        raise ValueError(f"tool_choice.type must be 'function', got {choice.get('type')!r}")
    fn = choice.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError("tool_choice.function.name must be a string")
    if fn["name"] not in names:
        raise ValueError(f"tool_choice.function.name {fn['name']!r} is not one of the tools")


# ------------------------------------------------------------------ forced calls


def tool_choice_constraint(
    tools: list | None, tool_choice: Any, parallel: bool = True
) -> tuple[str, str] | None:
    """The ("json_schema", schema) that forces a call, or None when the model may choose.
    `parallel` False: "required" allows exactly one call."""
    if not tools or tool_choice in (None, "none", "auto"):
        return None
    if tool_choice == "required":
        schema = _required_schema(tools)
        if not parallel:
            schema["maxItems"] = 1
        return "json_schema", json.dumps(schema)
    name = tool_choice["function"]["name"]
    for tool in tools:
        if tool["function"]["name"] == name:
            return "json_schema", json.dumps(_parameters(tool))
    raise ValueError(f"tool_choice.function.name {name!r} is not one of the tools")


def _parameters(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return dict(params) if params else dict(NO_PARAMETERS)


def _required_schema(tools: list) -> dict:
    """A JSON array (at least one item) of {"name": <a tool>, "parameters": <its schema>}."""
    schema: dict[str, Any] = {"type": "array", "minItems": 1}
    return _call_schema(tools, "parameters", schema, "items")


def _call_schema(tools: list, args_key: str, schema: dict, where: str | None) -> dict:
    """`schema` with the calls {"name": <a tool>, args_key: <its schema>} as an `anyOf` at
    `where` (None: the root). Each tool's `$defs` / `definitions` move to the root, where
    their `#/$defs/...` references resolve once the schema is nested."""
    hoisted: dict[str, dict] = {"$defs": {}, "definitions": {}}
    variants = []
    for i, tool in enumerate(tools):
        params = _parameters(tool)
        for key, defs in hoisted.items():
            for def_name, sub in (params.pop(key, None) or {}).items():
                if defs.setdefault(def_name, sub) != sub:
                    raise ValueError(
                        f"tools[{i}].function.parameters.{key}.{def_name} differs from another "
                        "tool's definition of the same name"
                    )
        variants.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "const": tool["function"]["name"]},
                    args_key: params,
                },
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    if where is None:
        schema["anyOf"] = variants
    else:
        schema[where] = {"anyOf": variants}
    schema.update({key: defs for key, defs in hoisted.items() if defs})
    return schema


def auto_tools_grammar(
    tools: list,
    fmt: str,
    parallel: bool = True,
    marker_token: int | None = None,
    thinking: str | None = None,
    think_ids: tuple[int | None, int | None] = (None, None),
) -> str:
    """The Lark grammar (llguidance) of a `tool_choice: "auto"` answer in format `fmt`: either
    text that never opens a call, or only calls, each naming a tool with arguments valid for
    its schema; one call when `parallel` is False. So a call the model starts is one the
    parser reads, and a call cut by max_tokens is a prefix of a valid one.

    hermes: `<tool_call>` blocks of {"name", "arguments"}, one per line; the text never
    contains `<tool_call>`. llama3_json: {"name", "parameters"} objects joined by "; " (what
    `_parse_llama3` reads); the text does not begin with "{" (there, a call would). mistral:
    `[TOOL_CALLS] [` calls joined by ", " `]`, the marker the tokenizer's own token
    (`marker_token`, so the model writes the one token it was trained on) or else the text.

    `thinking` (a reasoning model's, router/reasoning.py): the answer first thinks, text up to
    the `</think>` token (`think_ids`: the `<think>` and `</think>` token ids) and the blank
    lines after it; "undecided" (the model opens `<think>` itself) makes that optional."""
    if fmt not in TOOL_FORMATS:
        raise ValueError(f"no auto tool grammar for format {fmt!r}")
    from engine.structured.specs import JSON_OPTIONS

    hermes = fmt == "hermes"
    # The fixed JSON layout of response_format schemas: no free whitespace to wander into.
    layout = {"x-guidance": dict(JSON_OPTIONS)}
    args_key = "parameters" if fmt == "llama3_json" else "arguments"
    schema = json.dumps(_call_schema(tools, args_key, layout, None))
    sep = {"hermes": "\\n", "llama3_json": "; ", "mistral": ", "}[fmt]
    rules = [
        "answer: TEXT | calls",
        f'call_list: call ("{sep}" call)*' if parallel else "call_list: call",
    ]
    if fmt == "mistral":
        marker = f"<[{marker_token}]>" if marker_token is not None else json.dumps(MISTRAL_CALLS)
        rules.append(f'calls: {marker} " [" call_list "]"')
        rules.append("call: body")
        rules.append(f"TEXT: /(?s:.*)/ & ~/(?s:.*{re.escape(MISTRAL_CALLS)}.*)/")
        rules.append(f"body: %json {schema}")
        return _with_thinking(rules, thinking, think_ids)
    rules.append("calls: call_list")
    if hermes:
        rules.append(f'call: "{HERMES_OPEN}\\n" body "\\n{HERMES_CLOSE}"')
        rules.append(f"TEXT: /(?s:.*)/ & ~/(?s:.*{re.escape(HERMES_OPEN)}.*)/")
    else:
        rules.append("call: body")
        rules.append("TEXT: /(?s:.*)/ & ~/(?s:[ \\t\\r\\n]*\\{.*)/")
    rules.append(f"body: %json {schema}")
    return _with_thinking(rules, thinking, think_ids)


# After a reasoning model's thinking, the answer's text starts at its first visible character
# (the blank lines are GAP's): one lexeme holds them, so the lexer needs no look back to see
# a call's opener follow them.
_NO_LEADING_SPACE = r" & /(?s:([^ \t\r\n].*)?)/"


def _with_thinking(
    rules: list[str], thinking: str | None, think_ids: tuple[int | None, int | None]
) -> str:
    """`rules` (whose `answer` is an auto answer) after a reasoning model's thinking: text up
    to the `</think>` token (llguidance sees the markers as tokens of their own, `<[id]>`)."""
    if thinking in (None, "content"):
        return "\n".join(["start: answer", *rules])
    open_id, close_id = think_ids
    if close_id is None:
        raise ValueError("a thinking answer's grammar needs the </think> token")
    rules = [r + _NO_LEADING_SPACE if r.startswith("TEXT:") else r for r in rules]
    thought = [f"thought: THOUGHT? <[{close_id}]> GAP?", "THOUGHT: /(?s:.+)/", r"GAP: /[ \t\r\n]+/"]
    if thinking == "thinking":
        return "\n".join(["start: thought answer", *thought, *rules])
    opener = f"<[{open_id}]>" if open_id is not None else '"<think>"'
    return "\n".join([f"start: {opener} thought answer | answer", *thought, *rules])


def opens_call(text: str, fmt: str | None) -> bool:
    """Whether an answer made under auto_tools_grammar is calls (the grammar's other branch
    never begins like one)."""
    if fmt == "hermes":
        return text.startswith(HERMES_OPEN)
    if fmt == "mistral":
        return text.startswith(MISTRAL_CALLS)
    return fmt == "llama3_json" and text.lstrip().startswith("{")


# ------------------------------------------------------------------ formats


def detect_tool_format(chat_template: Any) -> str | None:
    """The tool-call format a chat template teaches its model, or None if neither is known."""
    if isinstance(chat_template, dict):  # named templates ("default", "tool_use", ...)
        chat_template = "\n".join(str(t) for t in chat_template.values())
    if not isinstance(chat_template, str) or not chat_template:
        return None
    if HERMES_OPEN in chat_template:
        return "hermes"
    if MISTRAL_CALLS in chat_template:
        return "mistral"
    # Llama 3.1+ templates show the JSON call shape in prose: {"name": function name,
    # "parameters": dictionary of argument name and its value}.
    if PYTHON_TAG in chat_template or '"parameters": dictionary' in chat_template:
        return "llama3_json"
    return None


def _tool_call(obj: Any, args_keys: tuple[str, ...]) -> dict | None:
    """OpenAI's shape for one parsed {"name", <args key>} object; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in args_keys if k in obj), None)
    args = {} if key is None else obj[key]
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


def _hermes_calls(rest: str) -> tuple[list[dict], list[str]] | None:
    """Parse `rest` (text from the first `<tool_call>` on): the calls and the stripped pieces of
    other text between or after them; None if a block is not a well-formed call. The last block
    may lack its closing tag (the model stopped at EOS right after the JSON)."""
    calls: list[dict] = []
    extras: list[str] = []
    pos = 0
    while True:
        start = rest.find(HERMES_OPEN, pos)
        between = rest[pos : len(rest) if start < 0 else start].strip()
        if between:
            extras.append(between)
        if start < 0:
            return calls, extras
        body_start = start + len(HERMES_OPEN)
        end = rest.find(HERMES_CLOSE, body_start)
        body = rest[body_start : len(rest) if end < 0 else end]
        try:
            call = _tool_call(json.loads(body), ("arguments", "parameters"))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return None
        calls.append(call)
        if end < 0:
            return calls, extras
        pos = end + len(HERMES_CLOSE)


def _parse_hermes(text: str) -> ParsedToolOutput:
    start = text.find(HERMES_OPEN)
    if start < 0:
        return ParsedToolOutput(text or None)
    parsed = _hermes_calls(text[start:])
    if parsed is None:
        return ParsedToolOutput(text)
    calls, extras = parsed
    head = text[:start].rstrip()
    return ParsedToolOutput("\n".join([head, *extras] if head else extras) or None, calls)


def _parse_llama3(text: str) -> ParsedToolOutput:
    """Calls only when the output starts with them (after an optional python tag); a JSON
    object that is not {"name", "parameters"} is an ordinary answer, returned as content."""
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].lstrip()
    if not body.startswith("{"):
        return ParsedToolOutput(text or None)
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    while True:
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return ParsedToolOutput(text)
        call = _tool_call(obj, ("parameters", "arguments"))
        if call is None:
            return ParsedToolOutput(text)
        calls.append(call)
        tail = body[pos:].lstrip()
        if not tail:
            return ParsedToolOutput(None, calls)
        if not tail.startswith(";"):
            return ParsedToolOutput(text)
        pos = len(body) - len(tail[1:].lstrip())


def mistral_calls(rest: str) -> list[dict] | None:
    """The calls in `rest` (the text after `[TOOL_CALLS]`): a JSON array of {"name",
    "arguments"} objects (or one such object) and nothing after it; None if it is not that."""
    body = rest.strip()
    try:
        obj, end = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError:
        return None
    calls = [
        _tool_call(o, ("arguments", "parameters"))
        for o in (obj if isinstance(obj, list) else [obj])
    ]
    if body[end:].strip() or not calls or None in calls:
        return None
    return calls


def _parse_mistral(text: str) -> ParsedToolOutput:
    start = text.find(MISTRAL_CALLS)
    if start < 0:
        return ParsedToolOutput(text or None)
    calls = mistral_calls(text[start + len(MISTRAL_CALLS) :])
    if calls is None:
        return ParsedToolOutput(text)
    return ParsedToolOutput(text[:start].rstrip() or None, calls)


_NINE = re.compile(r"[A-Za-z0-9]{9}")
_ALNUM = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def mistral_call_id(call_id: str | None, fallback: str) -> str:
    """A tool-call id as Mistral's templates require it (9 letters or digits; they raise on any
    other): kept if it is one, else derived from it (or from `fallback`) by a hash, so an
    assistant call and the tool result that names it map to the same id."""
    if call_id is not None and _NINE.fullmatch(call_id):
        return call_id
    n = int.from_bytes(hashlib.blake2b((call_id or fallback).encode(), digest_size=8).digest())
    return "".join(_ALNUM[(n // 62**i) % 62] for i in range(9))


def with_mistral_call_ids(messages: list[dict]) -> list[dict]:
    """`messages` (as the template reads them) with every call id and `tool_call_id` in
    Mistral's shape; OpenAI's "call_..." ids come back from clients unchanged otherwise."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "id": mistral_call_id(c.get("id"), f"{i}.{j}")}
                for j, c in enumerate(m["tool_calls"])
            ]
        if m.get("role") == "tool":
            m["tool_call_id"] = mistral_call_id(m.get("tool_call_id"), f"{i}")
        out.append(m)
    return out


def parse_tool_calls(text: str, fmt: str | None) -> ParsedToolOutput:
    """Split a finished output into content and tool calls; an unknown or None `fmt` means
    the model has no tool-call format: everything is content."""
    if fmt == "hermes":
        return _parse_hermes(text)
    if fmt == "llama3_json":
        return _parse_llama3(text)
    if fmt == "mistral":
        return _parse_mistral(text)
    return ParsedToolOutput(text or None)
