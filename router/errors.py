"""OpenAI-style errors: one exception type that knows its HTTP status, JSON body and headers.

Every 503 carries `Retry-After` (`UNAVAILABLE_RETRY_AFTER_S` unless the raiser gives its own):
the router is draining, has no worker, or lost one, all of which pass within seconds or are
for a load balancer to route around. A 429 `queue_full` gets its estimate from
router/admission.py.
"""

from __future__ import annotations

import json

from aiohttp import web
from pydantic import ValidationError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout_error",
}

# Retry-After (seconds) of a 503 that names none of its own.
UNAVAILABLE_RETRY_AFTER_S = 2


class APIError(Exception):
    """Raised anywhere in request handling; the server turns it into an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        if retry_after is None and status == 503:
            retry_after = UNAVAILABLE_RETRY_AFTER_S
        if retry_after is not None and (isinstance(retry_after, bool) or retry_after < 0):
            raise ValueError(f"retry_after must be an int >= 0, got {retry_after!r}")
        self.retry_after = retry_after
        self.type = type or _TYPES.get(
            status, "invalid_request_error" if status < 500 else ("internal_server_error")
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(int(self.retry_after))}

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            text=json.dumps(self.body()),
            content_type="application/json",
            headers=self.headers,
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ------------------------------------------------------------------ validation errors

_PREDICATES = {
    "missing": "is required",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be a boolean",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "extra_forbidden": "is not a known field",
    "greater_than_equal": "must be at least {ge}",
    "greater_than": "must be greater than {gt}",
    "less_than_equal": "must be at most {le}",
    "less_than": "must be less than {lt}",
    "literal_error": "must be one of {expected}",
    "too_short": "must hold at least {min_length} items",
    "too_long": "must hold at most {max_length} items",
    "string_too_short": "must not be empty",
    "string_pattern_mismatch": "must match {pattern}",
}
_CODES = {"missing_required", "model_not_found", "invalid_token_id", "empty_prompt"}


def _path(loc: tuple) -> tuple:
    """The error's place in the body, without one_of's `<type>` tags."""
    return tuple(p for p in loc if not (isinstance(p, str) and p.startswith("<")))


def _where(loc: tuple) -> str:
    if len(loc) == 1:
        return f"'{loc[0]}'"
    out = str(loc[0])
    for part in loc[1:]:
        out += f"[{part}]" if isinstance(part, int) else " key" if part == "[key]" else f".{part}"
    return out


def _rank(error: dict) -> int:
    if error["type"] == "model_not_found":
        return 0
    return 1 if error["type"] == "extra_forbidden" and len(_path(error["loc"])) == 1 else 2


def api_error(exc: ValidationError) -> APIError:
    """The first of a ValidationError's errors (the order: router/protocol.py's docstring) as
    a 4xx: `param` is the top-level field at fault; the message starts with its path."""
    err = min(exc.errors(include_url=False), key=_rank)
    kind, loc, ctx = err["type"], _path(err["loc"]), err.get("ctx") or {}
    if kind == "json_invalid":
        message = f"request body is not valid JSON: {ctx.get('error')}"[:500]
        return APIError(400, message, code="invalid_json")
    if not loc and kind in ("model_type", "dict_type", "model_attributes_type"):
        message = f"request body must be a JSON object, got {type(err['input']).__name__}"
        return APIError(400, message, code="invalid_json")
    param = ctx.get("param") or (str(loc[0]) if loc else None)
    predicate = ctx.get("predicate") or _PREDICATES.get(kind, err["msg"]).format(**ctx)
    if kind == "extra_forbidden" and len(loc) == 1:
        message = f"unknown field(s) for this request: {loc[0]!r}"
    elif ctx.get("whole") or not loc:
        message = predicate
    else:
        message = f"{_where(loc)} {predicate}"
    if (
        kind not in ("missing", "extra_forbidden")
        and kind in _PREDICATES
        and isinstance(err["input"], str | int | float)
    ):
        message += f", got {err['input']!r:.80}"
    code = "missing_required" if kind == "missing" else kind if kind in _CODES else None
    return APIError(ctx.get("status", 400), message, param=param, code=code)
