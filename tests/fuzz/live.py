"""Raw HTTP to a live router, and the invariants every answer must keep under fuzzing.

`send(url, Request)` opens one connection per request (http.client: no retries, no client-side
validation beyond what the HTTP framing needs) and returns an `Answer`; a connection the server
closed without answering is status 0. `Checker(doc).problems(request, answer)` lists what is
wrong with an answer, judged by the OpenAPI document (router/openapi.py):

- no answer at all, or any 5xx (no 503 is legitimate here: the test server's workers are up);
- an error (4xx) whose body is not the document's `ErrorBody` (OpenAI's error object);
- a 429 / 503 without a Retry-After header;
- a 200 JSON body that does not match the route's documented 200 schema, or a stream that does
  not end in `data: [DONE]` (a Responses API stream: in response.completed or .incomplete) or
  carries an error event.

It also counts answers by status (`counts`) for the benchmark's report.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field

from .schema_gen import SchemaGen

JSON_HEADERS = (("Content-Type", "application/json"),)


@dataclass(slots=True)
class Request:
    method: str
    path: str
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = JSON_HEADERS

    def __post_init__(self) -> None:
        if not self.method or not self.path.startswith("/"):
            raise ValueError(f"bad request line: {self.method!r} {self.path!r}")

    def short(self) -> str:
        return f"{self.method} {self.path[:80]} {self.body[:300]!r} ({len(self.body)} bytes)"


@dataclass(slots=True)
class Answer:
    status: int  # 0: the connection closed (or timed out) without an answer
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str = ""


def json_request(path: str, body: object, method: str = "POST") -> Request:
    return Request(method, path, json.dumps(body).encode())


def send(url: str, req: Request, timeout: float = 60.0) -> Answer:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.putrequest(req.method, req.path, skip_accept_encoding=True)
        for name, value in req.headers:
            conn.putheader(name, value)
        if req.body or req.method in ("POST", "PUT", "PATCH"):
            conn.putheader("Content-Length", str(len(req.body)))
        conn.endheaders(req.body or None)
        resp = conn.getresponse()
        return Answer(resp.status, dict(resp.getheaders()), resp.read())
    except (OSError, http.client.HTTPException) as e:
        return Answer(0, error=f"{type(e).__name__}: {e}")
    finally:
        conn.close()


class Checker:
    """Judges answers against the document; see the module docstring."""

    def __init__(self, doc: dict) -> None:
        self.doc = doc
        self.gen = SchemaGen(doc)
        self.error_body = self.gen.validator("ErrorBody")
        self.counts: Counter[int] = Counter()
        self._validators: dict[tuple[str, str, int], object] = {}

    def problems(self, req: Request, ans: Answer) -> list[str]:
        self.counts[ans.status] += 1
        if ans.status == 0:
            return [f"no answer ({ans.error})"]
        out = []
        if ans.status >= 500:
            out.append(f"server error {ans.status}: {ans.body[:300]!r}")
        if ans.status in (429, 503) and not ans.headers.get("Retry-After", "").isdigit():
            out.append(f"{ans.status} without an integer Retry-After")
        if req.method == "HEAD" or (ans.status != 200 and ans.status < 400):
            return out
        kind = ans.headers.get("Content-Type", "")
        if ans.status == 200 and kind.startswith("text/event-stream"):
            path = urllib.parse.urlsplit(req.path).path
            if path.rstrip("/") == "/v1/responses":
                return out + _responses_stream_problems(ans.body)
            return out + _stream_problems(ans.body)
        check = self._documented(req, ans.status)
        if check is None:
            return out
        try:
            body = json.loads(ans.body)
        except ValueError:
            return [*out, f"{ans.status} body is not JSON: {ans.body[:200]!r}"]
        errors = [e.message for e in check.iter_errors(body)]
        if errors:
            out.append(f"{ans.status} body does not match the document: {errors[:3]}")
        return out

    def _documented(self, req: Request, status: int):
        """The validator of the JSON body the document gives for this answer: the route's own,
        else (any error) OpenAI's error object; None for an undocumented 200."""
        path = urllib.parse.urlsplit(req.path).path
        method = req.method.lower()
        key = (path, method, status)
        if key not in self._validators:
            op = self.doc["paths"].get(path, {}).get(method, {})
            response = op.get("responses", {}).get(str(status))
            pointer: tuple[str, ...] | None = None
            if response is not None and "$ref" in response:
                pointer = tuple(response["$ref"].removeprefix("#/").split("/"))
                response = self.gen.resolve(response)
            elif response is not None:
                pointer = ("paths", path, method, "responses", str(status))
            if response is not None and "application/json" in response.get("content", {}):
                at = (*pointer, "content", "application/json", "schema")
                self._validators[key] = self.gen.validator_at(*at)
            else:
                self._validators[key] = self.error_body if status >= 400 else None
        return self._validators[key]


# The events that end a Responses API stream (it has no `[DONE]`; router/responses_output.py).
_RESPONSES_ENDS = (b"event: response.completed\n", b"event: response.incomplete\n")


def _responses_stream_problems(body: bytes) -> list[str]:
    events = [e for e in body.split(b"\n\n") if e.strip()]
    if not events or not events[-1].startswith(_RESPONSES_ENDS):
        return [f"responses stream does not end in a final event: {body[-200:]!r}"]
    if any(e.startswith((b"event: error\n", b"event: response.failed\n")) for e in events):
        return [f"responses stream carries an error event: {body[-400:]!r}"]
    return []


def _stream_problems(body: bytes) -> list[str]:
    events = [e for e in body.split(b"\n\n") if e.strip()]
    if not events or events[-1] != b"data: [DONE]":
        return [f"stream does not end in [DONE]: {body[-200:]!r}"]
    if any(e.startswith(b'data: {"error"') for e in events):
        return [f"stream carries an error event: {body[-400:]!r}"]
    return []


def still_serving(url: str, model: str, timeout: float = 60.0) -> list[str]:
    """/health answers 200 and a plain completion generates its tokens (empty: all good)."""
    health = send(url, Request("GET", "/health"), timeout)
    out = [] if health.status == 200 else [f"/health answered {health.status}"]
    body = {"model": model, "prompt": "the quick brown fox", "max_tokens": 4, "temperature": 0}
    t0 = time.monotonic()
    ans = send(url, json_request("/v1/completions", body), timeout)
    if ans.status != 200:
        return [*out, f"completion answered {ans.status}: {ans.body[:300]!r}"]
    usage = json.loads(ans.body)["usage"]
    if usage["completion_tokens"] != 4:
        out.append(f"completion generated {usage['completion_tokens']} tokens, not 4")
    if time.monotonic() - t0 > timeout / 2:
        out.append(f"completion took {time.monotonic() - t0:.1f}s")
    return out
