"""Tool calls as they are generated (the incremental halves of router/tools.py).

- `ToolStreamParser(fmt)`: for `tool_choice` "auto", the content that is safe to stream now
  and, at the end, the calls the model wrote in its template's format (`parse_tool_calls`).
- `ForcedCallParser(tool_choice)`: a forced call's text (or auto calls the grammar made
  valid) as OpenAI tool-call deltas, id and name first, then argument fragments; a call cut by
  the length limit keeps the arguments written until then.

Pure functions of their inputs, like router/tools.py.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from router.reasoning import partial_marker
from router.tools import (
    HERMES_OPEN,
    MISTRAL_CALLS,
    PYTHON_TAG,
    TOOL_FORMATS,
    ParsedToolOutput,
    _hermes_calls,
    _parse_llama3,
    mistral_calls,
)


class ToolStreamParser:
    """Incremental `parse_tool_calls`: `feed(delta)` returns the content that is safe to send
    now; `finish()` returns the rest of the content and the tool calls. The pieces add up to
    the one-shot result: "".join(feeds) + (finish().content or "") == parse_tool_calls(...)
    .content or "".

    Held back: trailing whitespace (content before a call is sent right-stripped) and any
    tail that may begin a call marker (a partial "<tool_"); once a marker (hermes, mistral) or
    a leading "{" (llama3_json) shows up, everything after it until finish().
    """

    def __init__(self, fmt: str | None) -> None:
        self.fmt = fmt if fmt in TOOL_FORMATS else None
        self._buf = ""  # text not yet sent: held content, or the call text
        self._gap = ""  # whitespace dropped before a marker (sent back on a fallback)
        self._marker = MISTRAL_CALLS if self.fmt == "mistral" else HERMES_OPEN
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
        if self.fmt == "llama3_json":
            return self._feed_llama3()
        return self._feed_marked()

    def _emit(self, text: str) -> str:
        self._sent_any = self._sent_any or bool(text)
        return text

    def _feed_marked(self) -> str:
        """hermes and mistral: content until the first call marker, anywhere in the text."""
        start = self._buf.find(self._marker)
        if start >= 0:
            head = self._buf[:start].rstrip()
            self._gap = self._buf[len(head) : start]
            self._buf, self._in_calls = self._buf[start:], True
            return self._emit(head)
        cut = len(self._buf) - partial_marker(self._buf, self._marker)
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
        if self.fmt == "mistral":
            calls = mistral_calls(rest[len(MISTRAL_CALLS) :])
            return (
                ParsedToolOutput(self._gap + rest)
                if calls is None
                else ParsedToolOutput(None, calls)
            )
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
