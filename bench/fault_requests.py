"""Requests whose outcome under a fault is judged: correct, a clear error, or wrong.

A request is *correct* when it answers 200 with exactly the text the healthy server gave for
the same greedy request (its reference); a *clear error* is an HTTP error with an OpenAI error
body, or, once a stream began, an error event followed by `data: [DONE]`, with whatever text
came before it a prefix of the reference; anything else is *wrong*: different text, a stream
cut off without [DONE], a body that is not an OpenAI error, no answer before the deadline.
`Tally` counts them per fault case.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

CORRECT, ERROR, WRONG = "correct", "error", "wrong"


@dataclass(slots=True)
class Outcome:
    kind: str  # CORRECT | ERROR | WRONG
    status: int
    detail: str = ""
    seconds: float = 0.0
    text: str = ""  # what the client got (judged later when there was no reference yet)

    def judge(self, expect: str) -> Outcome:
        """This outcome against a reference taken after the fact."""
        if self.kind == CORRECT and self.text != expect:
            return Outcome(WRONG, self.status, f"text {self.text!r} != {expect!r}", self.seconds)
        if self.kind == ERROR and not expect.startswith(self.text):
            return Outcome(WRONG, self.status, f"{self.text!r} is not a prefix", self.seconds)
        return self


@dataclass(slots=True)
class Tally:
    case: str
    policy: str = ""
    outcomes: list[Outcome] = field(default_factory=list)
    leaked_blocks: int = 0
    recovery_s: float | None = None
    notes: str = ""

    def count(self, kind: str) -> int:
        return sum(o.kind == kind for o in self.outcomes)

    def row(self) -> dict:
        return {
            "case": self.case,
            "policy": self.policy,
            "sent": len(self.outcomes),
            "correct": self.count(CORRECT),
            "clear_errors": self.count(ERROR),
            "wrong": self.count(WRONG),
            "leaked_blocks": self.leaked_blocks,
            "recovery_s": None if self.recovery_s is None else round(self.recovery_s, 2),
            "notes": self.notes,
        }

    def wrong_details(self) -> list[str]:
        return [f"{o.status}: {o.detail}" for o in self.outcomes if o.kind == WRONG]


def completion_body(prompt: str, max_tokens: int, stream: bool) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def _error_outcome(status: int, body: str, t0: float) -> Outcome:
    try:
        err = json.loads(body)["error"]
        ok = isinstance(err["message"], str) and "type" in err
    except (ValueError, KeyError, TypeError):
        ok = False
    kind = ERROR if ok and status >= 400 else WRONG
    return Outcome(kind, status, body[:200], time.monotonic() - t0)


async def whole(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, expect: str | None
) -> Outcome:
    t0 = time.monotonic()
    body = completion_body(prompt, max_tokens, False)
    async with session.post(url + "/v1/completions", json=body) as resp:
        text = await resp.text()
    if resp.status != 200:
        return _error_outcome(resp.status, text, t0)
    got = json.loads(text)["choices"][0]["text"]
    kind = CORRECT if expect is None or got == expect else WRONG
    detail = "" if kind == CORRECT else f"text {got!r} != {expect!r}"
    return Outcome(kind, 200, detail, time.monotonic() - t0, got)


async def stream(
    session: aiohttp.ClientSession,
    url: str,
    prompt: str,
    max_tokens: int,
    expect: str | None,
    started: asyncio.Event | None = None,
) -> Outcome:
    """One streamed completion; `started` is set at its first text chunk."""
    t0 = time.monotonic()
    body = completion_body(prompt, max_tokens, True)
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return _error_outcome(resp.status, await resp.text(), t0)
        text, error = "", None
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return _judge_stream(text, error, expect, t0)
            if error is not None:
                return Outcome(WRONG, 200, f"data after the error event: {data[:100]}")
            event = json.loads(data)
            if "error" in event:
                error = event["error"].get("message", "?")
                continue
            text += event["choices"][0]["text"]
            if started is not None:
                started.set()
    return Outcome(WRONG, 200, f"stream cut off without [DONE] after {text!r}")


def _judge_stream(text: str, error: str | None, expect: str | None, t0: float) -> Outcome:
    seconds = time.monotonic() - t0
    if expect is not None and not expect.startswith(text):
        return Outcome(WRONG, 200, f"text {text!r} is not a prefix of {expect!r}", seconds, text)
    if error is not None:
        return Outcome(ERROR, 200, error[:200], seconds, text)
    if expect is not None and text != expect:
        return Outcome(WRONG, 200, f"stream ended early: {text!r}", seconds, text)
    return Outcome(CORRECT, 200, "", seconds, text)


async def guarded(coro, deadline_s: float) -> Outcome:
    """`coro`'s outcome, or WRONG when it hangs past `deadline_s` or the connection breaks
    (the server must answer, even if only with an error)."""
    try:
        return await asyncio.wait_for(coro, deadline_s)
    except TimeoutError:
        return Outcome(WRONG, 0, f"no answer within {deadline_s}s")
    except (aiohttp.ClientError, ConnectionError) as e:
        return Outcome(WRONG, 0, f"connection failed: {type(e).__name__}: {e}")


def session(timeout_s: float = 120.0) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        connector=aiohttp.TCPConnector(limit=256),
    )
