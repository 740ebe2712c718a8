"""Structured-output specs -> llguidance grammars, and their validation.

A request's `SamplingParams.structured` is a `(kind, spec)` pair of strings (see
engine/protocol.py). This module turns one into the grammar text llguidance compiles
and checks it, with no tokenizer and no torch, so the router can reject a bad spec with a 400
before a worker sees it.
"""

from __future__ import annotations

import json

from llguidance import LLMatcher, grammar_from

from engine.protocol import STRUCTURED_KINDS

# Whitespace inside generated JSON. Flexible whitespace lets a weak model emit spaces and
# newlines until max_tokens (a known failure of every backend that allows it), and leaves the
# separators to chance; a fixed layout ends every walk and costs no expressiveness. ", " and ": "
# are json.dumps' defaults, the layout models meet most often (and Hermes tool calls use).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# "Any JSON object", as OpenAI's response_format {"type": "json_object"} promises.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class StructuredError(ValueError):
    """A structured-output spec that cannot be compiled; the message names the problem."""


def grammar_text(kind: str, spec: str) -> str:
    """The llguidance grammar for (kind, spec); raises StructuredError when the spec is not even
    well-formed (not JSON where JSON is expected, wrong type). Grammar-level errors (an invalid
    regex, an unsupported schema keyword) are found by `check_grammar`."""
    if kind not in STRUCTURED_KINDS:
        raise StructuredError(f"unknown structured output kind {kind!r}; one of {STRUCTURED_KINDS}")
    if not isinstance(spec, str):
        raise StructuredError(f"{kind} spec must be a string, got {type(spec).__name__}")
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(_schema(spec), defaults=JSON_OPTIONS)
    if kind == "regex":
        if not spec:
            raise StructuredError("regex must not be empty")
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return LLMatcher.grammar_from_lark(_choice_lark(spec))
    if not spec.strip():
        raise StructuredError("grammar must not be empty")
    try:
        # "grammar" also takes GBNF (llama.cpp's format, which xgrammar users send) by turning
        # it into Lark; Lark text passes through unchanged.
        return grammar_from("grammar", spec)
    except ValueError as e:
        raise StructuredError(f"invalid grammar: {e}") from None


def _schema(spec: str) -> str:
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as e:
        raise StructuredError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise StructuredError(
            f"json_schema must be a JSON object (or boolean), got {type(schema).__name__}"
        )
    # Re-serialised so llguidance never sees duplicate keys or odd spacing twice differently.
    return json.dumps(schema)


def _choice_lark(spec: str) -> str:
    try:
        options = json.loads(spec)
    except json.JSONDecodeError as e:
        raise StructuredError(f"choice must be a JSON list of strings: {e}") from None
    if not isinstance(options, list) or not options:
        raise StructuredError("choice must be a non-empty JSON list of strings")
    for i, option in enumerate(options):
        if not isinstance(option, str):
            raise StructuredError(f"choice[{i}] must be a string, got {type(option).__name__}")
    # Lark string literals take JSON's escapes, so json.dumps quotes any option exactly.
    return "start: " + " | ".join(json.dumps(o) for o in options)


def check_grammar(kind: str, grammar: str, tokenizer=None) -> None:
    """Raise StructuredError if llguidance rejects `grammar` (made by `grammar_text`)."""
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise StructuredError(f"invalid {kind}: {_first_lines(messages[0])}")


def _first_lines(message: str, limit: int = 6) -> str:
    """llguidance appends grammar listings and parser state dumps; the cause comes first."""
    lines = [ln for ln in message.strip().splitlines() if ln.strip()]
    cut = next((i for i, ln in enumerate(lines) if ln.startswith("<state>")), len(lines))
    return "\n".join(lines[: min(cut, limit)])


def validate(kind: str, spec: str) -> None:
    """Check a (kind, spec) pair without a tokenizer: what the router runs on each request."""
    check_grammar(kind, grammar_text(kind, spec))
