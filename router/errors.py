"""OpenAI-style errors: one exception type that knows its HTTP status, JSON body and headers.

Every 503 carries `Retry-After` (`UNAVAILABLE_RETRY_AFTER_S` unless the raiser gives its own):
the router is draining, has no worker, or lost one, all of which pass within seconds or are
for a load balancer to route around. A 429 `queue_full` gets its estimate from
router/admission.py.
"""

from __future__ import annotations

import json

from aiohttp import web

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
