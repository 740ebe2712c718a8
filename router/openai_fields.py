"""OpenAI request fields tandem accepts without acting on them, and those it refuses unless
left empty; the list is OpenAI's chat API as of 2026 (plus the Responses API's shared ones).

An accepted field is named back in `X-Tandem-Ignored-Fields` when it is set (not null), and
logged once as an OpenAI field with no effect here, so a client sees what was not honoured;
a field whose request tandem cannot serve is a 400 naming it. Fields of chat messages that
clients send back as they received them (`audio`, `annotations`, `refusal`, a legacy
`function_call`) are accepted with their documented types the same way; a legacy
`function_call` of an assistant message is used as its tool call.
"""

from __future__ import annotations

from typing import Any

# name -> why it has no effect here (the log line says so once per name)
ACCEPTED = {
    "store": "chat completions are not stored",
    "metadata": "requests are not stored, so their metadata is not either",
    "service_tier": "one tier",
    "reasoning_effort": "no reasoning budget in these models",
    "prompt_cache_key": "prefix caching is automatic",
    "safety_identifier": "no abuse monitoring here",
    "prediction": "predicted outputs are not used to speed decoding",
    "verbosity": "no verbosity control",
}
# name -> (the values that are fine, why others are refused)
REFUSED_UNLESS = {
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "web_search_options": ((None,), "web search is not available"),
}
MESSAGE_ACCEPTED = ("refusal", "audio", "annotations", "function_call")
# Fields tandem does not serve, refused unless left at their defaults (router/protocol.py).
REFUSED = {
    "suffix": "insertion (suffix) is not supported by these models",
    "functions": "the legacy 'functions' field is not supported; use 'tools'",
    "function_call": "the legacy 'function_call' field is not supported; use 'tool_choice'",
    "spaces_between_special_tokens": "only the default (true) is supported",
    "structural_tag": "structural tags are not supported; use a grammar",
    "use_beam_search": "beam search is not supported; use n or best_of",
    "chat_template": (
        "a request's own chat template would run the client's Jinja in the router (vLLM refuses"
        " it too unless told to trust request templates); the server's --chat-template applies"
    ),
    "logits_processors": (
        "per-request logits processors (code named by the client) are not loaded; vLLM refuses"
        " them too unless started with --logits-processor-pattern"
    ),
}
# vLLM's `request_id` and the `X-Request-Id` header: the answer's id after its prefix.
MAX_REQUEST_ID = 256
REQUEST_ID_PATTERN = r"^[!-~]+$"  # visible ASCII: it is sent back in a header
# Why a priority other than 0 is refused under the fcfs policy (vLLM's rule too).
PRIORITY_NEEDS_POLICY = (
    "'priority': only 0 unless the workers run --scheduling-policy priority; this deployment "
    "serves requests first come, first served"
)


def refusal(name: str, value: Any) -> str | None:
    """Why `name` set to `value` cannot be served, or None."""
    if name not in REFUSED_UNLESS:
        return None
    allowed, why = REFUSED_UNLESS[name]
    return None if value in allowed else f"'{name}': {why}"


def message_fields(messages: list[Any]) -> list[str]:
    """Set message fields tandem does not use, as `messages[i].name` (a legacy
    `function_call` of an assistant message is used: it becomes the message's tool call)."""
    out = []
    for i, message in enumerate(messages):
        legacy_call = message.role == "assistant" and not message.tool_calls
        for name in MESSAGE_ACCEPTED:
            used = name == "function_call" and legacy_call
            if getattr(message, name) not in (None, [], "") and not used:  # set to something
                out.append(f"messages[{i}].{name}")
        if isinstance(message.content, list):  # a text part's other keys (`cache_control`)
            for j, part in enumerate(message.content):
                out += [f"messages[{i}].content[{j}].{k}" for k in sorted(part.model_extra or {})]
    return out


# Request objects whose unknown keys nothing reads (a tool's are passed to the chat template).
NESTED = ("stream_options", "response_format", "structured_outputs")


def nested_fields(req: Any) -> list[str]:
    """Set keys of a request's objects that have no effect, by path: unknown keys
    (`structured_outputs.disable_any_whitespace`), and continuous usage stats not asked for
    with include_usage (vLLM's rule: they need it)."""
    out = []
    for name in NESTED:
        value = getattr(req, name, None)
        out += [f"{name}.{key}" for key in sorted(getattr(value, "model_extra", None) or {})]
        schema = getattr(value, "json_schema", None)  # response_format.json_schema
        out += [f"{name}.json_schema.{k}" for k in sorted(getattr(schema, "model_extra", {}) or {})]
    options = getattr(req, "stream_options", None)
    if getattr(options, "continuous_usage_stats", None) and not options.include_usage:
        out.append("stream_options.continuous_usage_stats")
    return out
