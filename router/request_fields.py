"""Which OpenAI (and vLLM extra) request fields the router knows, and the validation of the
sampling, log-probability and structured-output fields shared by both generation routes.

Every field a client can send is in one of three sets per route: supported (it works),
refused (a 400 naming it: the field exists in OpenAI's API but tandem does not serve it), or
unknown (not an API field at all: logged once per name and listed in the `X-Tandem-Ignored-Fields`
response header, as vLLM warns about extra fields). Nothing is silently ignored.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from router.errors import APIError, bad_request

log = logging.getLogger(__name__)

MAX_LOGPROBS = 20
MAX_N = 128

# Fields both routes accept. `user` is OpenAI's abuse-tracking id: it has no effect on output
# in OpenAI's API either.
_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
    "presence_penalty", "frequency_penalty", "logit_bias", "seed", "user",
    # vLLM's extra sampling fields
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
    "add_special_tokens", "response_format", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "structured_outputs", "prompt_logprobs",
}  # fmt: skip
COMPLETION_FIELDS = _COMMON | {"prompt", "suffix", "logprobs", "echo", "best_of"}
CHAT_FIELDS = _COMMON | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "add_generation_prompt", "continue_final_message", "echo",
    "chat_template_kwargs", "functions", "function_call",
}  # fmt: skip
# OpenAI fields tandem refuses with a 400 when set to anything but their default.
REFUSED = {
    "suffix": "insertion (suffix) is not supported by these models",
    "functions": "the legacy 'functions' field is not supported; use 'tools'",
    "function_call": "the legacy 'function_call' field is not supported; use 'tool_choice'",
    "spaces_between_special_tokens": "only the default (true) is supported",
}
_warned: set[str] = set()


def check_body_and_model(body: Any, served_model_name: str) -> dict:
    """A JSON object whose `model`, when given, is the served one (else 400 / 404)."""
    if not isinstance(body, dict):
        raise bad_request(
            f"request body must be a JSON object, got {type(body).__name__}",
            code="invalid_json",
        )
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise bad_request("'model' must be a string", param="model")
        if model != served_model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{served_model_name}`.",
                param="model",
                code="model_not_found",
            )
    return body


def unknown_fields(body: dict, known: set[str]) -> list[str]:
    """Fields that are not API fields: logged once per name, returned for the header."""
    unknown = sorted(k for k in body if k not in known)
    for name in unknown:
        if name not in _warned and len(_warned) < 1024:
            _warned.add(name)
            log.warning("ignoring unknown request field %r (not an OpenAI or vLLM field)", name)
    return unknown


def refuse_unsupported(body: dict) -> None:
    for name, why in REFUSED.items():
        value = body.get(name)
        if name == "spaces_between_special_tokens":
            if value not in (None, True):
                raise bad_request(f"'{name}': {why}", name)
        elif value not in (None, [], ""):
            raise bad_request(f"'{name}': {why}", name)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def optional_bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean", name)
    return value


def number(body: dict, name: str, default: float, lo: float, hi: float, lo_open=False) -> float:
    value = body.get(name)
    if value is None:
        return default
    ok = is_number(value) and math.isfinite(value) and lo <= value <= hi
    if not ok or (lo_open and value == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise bad_request(f"'{name}' must be a number in {bound}, got {value!r}", name)
    return float(value)


def count(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value) or not lo <= value <= hi:
        raise bad_request(f"'{name}' must be an integer in [{lo}, {hi}], got {value!r}", name)
    return value


def logit_bias(body: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} map (keys are strings in JSON) -> (id, bias) pairs."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict) or len(bias) > 300:
        raise bad_request("'logit_bias' must be an object of at most 300 entries", "logit_bias")
    out = []
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(
                f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})",
                "logit_bias",
            )
        if not is_number(value) or not -100 <= value <= 100:
            raise bad_request(
                f"logit_bias values must be in [-100, 100], got {value!r}", "logit_bias"
            )
        out.append((token, float(value)))
    return tuple(out)


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, huge ints, depth
            raise bad_request(f"'{param}' is not valid JSON: {e}", param) from e
    if not isinstance(schema, dict | bool):
        raise bad_request(f"'{param}' must be a JSON schema object", param)
    return json.dumps(schema)


def _response_format(fmt: Any) -> tuple[str, str] | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad_request("response_format must be an object with a 'type'", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", "")
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise bad_request(
                "response_format json_schema needs {'json_schema': {'name', 'schema'}}",
                "response_format",
            )
        return ("json_schema", _schema_text(inner["schema"], "response_format"))
    raise bad_request(
        f"response_format type {kind!r} is not one of text, json_object, json_schema",
        "response_format",
    )


def structured_spec(body: dict) -> tuple[tuple[str, str] | None, str]:
    """The one structured-output constraint a request asks for (OpenAI response_format, vLLM's
    guided_* fields, or vLLM's structured_outputs object) and the field that asked; two at once
    is a 400."""
    specs: list[tuple[str, tuple[str, str] | None]] = []
    if body.get("response_format") is not None:
        specs.append(("response_format", _response_format(body["response_format"])))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("structured_outputs must be an object", "structured_outputs")
        body = {f"guided_{k}": v for k, v in so.items()} | {"_from": "structured_outputs"}
    for name, kind in (("json", "json_schema"), ("regex", "regex"), ("choice", "choice"),
                       ("grammar", "grammar")):  # fmt: skip
        value = body.get(f"guided_{name}")
        if value is None:
            continue
        param = body.get("_from", f"guided_{name}")
        if kind == "json_schema":
            specs.append((param, (kind, _schema_text(value, param))))
        elif kind == "choice":
            if (
                not isinstance(value, list)
                or not value
                or not all(isinstance(c, str) for c in value)
            ):
                raise bad_request(f"'{param}' choice must be a non-empty list of strings", param)
            specs.append((param, (kind, json.dumps(value))))
        elif not isinstance(value, str) or not value:
            raise bad_request(f"'{param}' {name} must be a non-empty string", param)
        else:
            specs.append((param, (kind, value)))
    real = [(p, s) for p, s in specs if s is not None]
    if len(real) > 1:
        raise bad_request(
            f"only one structured output constraint per request, got {[p for p, _ in real]}",
            real[1][0],
        )
    return (real[0][1], real[0][0]) if real else (None, "response_format")
