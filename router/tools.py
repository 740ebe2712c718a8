"""OpenAI tool calling: request validation, forced-call constraints and output parsers.

- `validate_tools(tools, tool_choice)`: the OpenAI shape, or a ValueError naming the field path
  (the request parser turns it into a 400).
- `tool_choice_constraint(tools, tool_choice)`: the structured-output spec that makes the model
  call a tool ("required": a JSON array of {"name", "parameters"}, vLLM's format; a named
  function: its arguments object), or None ("auto" and "none" leave the model free).
- `parse_tool_calls(text, fmt)` / `ToolStreamParser(fmt)`: for "auto", the calls the model chose
  to write in its chat template's own format: "hermes" (Qwen2.5, Hermes: `<tool_call>` blocks)
  or "llama3_json" (Llama 3.x: `{"name", "parameters"}` objects, optionally after
  `<|python_tag|>`, separated by `;`). Malformed call text is returned as plain content.
- `detect_tool_format(chat_template)`: which of those a model's template teaches it.

Pure functions of their inputs (no torch, no I/O), so the router imports them freely.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_FORMATS = ("hermes", "llama3_json")
TOOL_CHOICE_MODES = ("none", "auto", "required")
# OpenAI's rule for function names.
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
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


def auto_tools_grammar(tools: list, fmt: str, parallel: bool = True) -> str:
    """The Lark grammar (llguidance) of a `tool_choice: "auto"` answer in format `fmt`: either
    text that never opens a call, or only calls, each naming a tool with arguments valid for
    its schema; one call when `parallel` is False. So a call the model starts is one the
    parser reads, and a call cut by max_tokens is a prefix of a valid one.

    hermes: `<tool_call>` blocks of {"name", "arguments"}, one per line; the text never
    contains `<tool_call>`. llama3_json: {"name", "parameters"} objects joined by "; " (what
    `_parse_llama3` reads); the text does not begin with "{" (there, a call would)."""
    if fmt not in TOOL_FORMATS:
        raise ValueError(f"no auto tool grammar for format {fmt!r}")
    from engine.structured.specs import JSON_OPTIONS

    hermes = fmt == "hermes"
    # The fixed JSON layout of response_format schemas: no free whitespace to wander into.
    layout = {"x-guidance": dict(JSON_OPTIONS)}
    schema = json.dumps(_call_schema(tools, "arguments" if hermes else "parameters", layout, None))
    sep = "\\n" if hermes else "; "
    rules = ["start: TEXT | calls", f'calls: call ("{sep}" call)*' if parallel else "calls: call"]
    if hermes:
        rules.append(f'call: "{HERMES_OPEN}\\n" body "\\n{HERMES_CLOSE}"')
        rules.append(f"TEXT: /(?s:.*)/ & ~/(?s:.*{re.escape(HERMES_OPEN)}.*)/")
    else:
        rules.append("call: body")
        rules.append("TEXT: /(?s:.*)/ & ~/(?s:[ \\t\\r\\n]*\\{.*)/")
    rules.append(f"body: %json {schema}")
    return "\n".join(rules)


def opens_call(text: str, fmt: str | None) -> bool:
    """Whether an answer made under auto_tools_grammar is calls (the grammar's other branch
    never begins like one)."""
    if fmt == "hermes":
        return text.startswith(HERMES_OPEN)
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


def parse_tool_calls(text: str, fmt: str | None) -> ParsedToolOutput:
    """Split a finished output into content and tool calls; an unknown or None `fmt` means
    the model has no tool-call format: everything is content."""
    if fmt == "hermes":
        return _parse_hermes(text)
    if fmt == "llama3_json":
        return _parse_llama3(text)
    return ParsedToolOutput(text or None)


# ------------------------------------------------------------------ streaming


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolStreamParser:
    """Incremental `parse_tool_calls`: `feed(delta)` returns the content that is safe to send
    now; `finish()` returns the rest of the content and the tool calls. The pieces add up to
    the one-shot result: "".join(feeds) + (finish().content or "") == parse_tool_calls(...)
    .content or "".

    Held back: trailing whitespace (content before a call is sent right-stripped) and any
    tail that may begin a call marker (a partial "<tool_"); once a marker (hermes) or a
    leading "{" (llama3_json) shows up, everything after it until finish().
    """

    def __init__(self, fmt: str | None) -> None:
        self.fmt = fmt if fmt in TOOL_FORMATS else None
        self._buf = ""  # text not yet sent: held content, or the call text
        self._gap = ""  # whitespace dropped before a hermes marker (sent back on a fallback)
        self._in_calls = False
        self._sent_any = False  # some non-empty content has been returned by feed()
        self._decided = self.fmt != "llama3_json"  # llama3: calls can only open the output

    @property
    def in_tool_calls(self) -> bool:
        """A tool-call marker was seen: the rest of the output is being held."""
        return self._in_calls

    @property
    def held(self) -> str:
        """The text held since the first call marker ("" before one)."""
        return self._buf if self._in_calls else ""

    def feed(self, delta: str) -> str:
        if self.fmt is None:
            return delta
        self._buf += delta
        if self._in_calls:
            return ""
        if self.fmt == "hermes":
            return self._feed_hermes()
        return self._feed_llama3()

    def _emit(self, text: str) -> str:
        self._sent_any = self._sent_any or bool(text)
        return text

    def _feed_hermes(self) -> str:
        start = self._buf.find(HERMES_OPEN)
        if start >= 0:
            head = self._buf[:start].rstrip()
            self._gap = self._buf[len(head) : start]
            self._buf, self._in_calls = self._buf[start:], True
            return self._emit(head)
        cut = len(self._buf) - _partial_suffix(self._buf, HERMES_OPEN)
        while cut > 0 and self._buf[cut - 1].isspace():
            cut -= 1
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return self._emit(out)

    def _feed_llama3(self) -> str:
        if self._decided:
            out, self._buf = self._buf, ""
            return self._emit(out)
        body = self._buf.lstrip()
        if not body or (PYTHON_TAG.startswith(body) and body != PYTHON_TAG):
            return ""  # only whitespace or part of the tag so far: wait
        if body.startswith(PYTHON_TAG) or body.startswith("{"):
            self._in_calls = True
            return ""
        self._decided = True
        out, self._buf = self._buf, ""
        return self._emit(out)

    def finish(self) -> ParsedToolOutput:
        """The content not yet sent and the tool calls; the parser is spent afterwards."""
        rest, self._buf = self._buf, ""
        if not self._in_calls:
            return ParsedToolOutput(rest or None)
        if self.fmt == "llama3_json":
            return _parse_llama3(rest)
        parsed = _hermes_calls(rest)
        if parsed is None:
            return ParsedToolOutput(self._gap + rest)
        calls, extras = parsed
        text = "\n".join(extras)
        if text and self._sent_any:
            text = "\n" + text
        return ParsedToolOutput(text or None, calls)


# ------------------------------------------------------------------ forced calls, streamed

# One call, up to its arguments: a "required" item (the schema lists "name" first) or a
# Hermes block's JSON ({"name", "arguments"}, as auto_tools_grammar writes it).
_CALL_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"(?:parameters|arguments)"\s*:\s*'
)


def _object_end(text: str, start: int) -> int | None:
    """The index just past the JSON object that opens at or after `start`, or None while it
    is still open (strings and escapes skipped, so braces inside them do not count)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
            continue
        if ch == '"':
            in_string = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class ForcedCallParser:
    """A forced call's text, as it is generated, as OpenAI tool-call deltas: for each call its
    id, type and name first (arguments ""), then argument fragments as they arrive. The text
    is the arguments object (a named function), a JSON array of {"name", "parameters"}
    ("required"), or Hermes blocks under auto_tools_grammar (`tool_choice` None). `calls()`
    gives the calls so far: a call the length limit cut keeps the arguments written until
    then, as OpenAI returns them."""

    def __init__(self, tool_choice: Any) -> None:
        self.named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        self.text = ""
        self._calls: list[dict[str, Any]] = []  # id, name, start, end (None: open), sent
        self._scan = 0  # "required": where the next item is looked for

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        if self.named is not None:
            if not self._calls and self.text.strip():
                self._calls.append(self._call(self.named, 0))
        else:
            self._advance()
        return self._deltas()

    @staticmethod
    def _call(name: str, start: int) -> dict[str, Any]:
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        return {"id": call_id, "name": name, "start": start, "end": None, "sent": -1}

    def _advance(self) -> None:
        while True:
            if self._calls and self._calls[-1]["end"] is None:
                end = _object_end(self.text, self._calls[-1]["start"])
                if end is None:
                    return
                self._calls[-1]["end"] = self._scan = end
            head = _CALL_HEAD.search(self.text, self._scan)
            if head is None:
                return
            self._calls.append(self._call(head.group(1), head.end()))

    def _arguments(self, call: dict[str, Any]) -> str:
        end = call["end"] if call["end"] is not None else len(self.text)
        return self.text[call["start"] : end].strip()

    def _deltas(self) -> list[dict[str, Any]]:
        out = []
        for i, call in enumerate(self._calls):
            args = self._arguments(call)
            if call["sent"] < 0:
                fn = {"name": call["name"], "arguments": ""}
                out.append({"index": i, "id": call["id"], "type": "function", "function": fn})
                call["sent"] = 0
            if len(args) > call["sent"]:
                out.append({"index": i, "function": {"arguments": args[call["sent"] :]}})
                call["sent"] = len(args)
        return out

    def calls(self) -> list[dict[str, Any]]:
        return [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": self._arguments(c)},
            }
            for c in self._calls
        ]
