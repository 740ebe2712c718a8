"""Reading a request body's bytes, with every way they can be hostile before parsing a 4xx.

- too slow (a slow-loris client dribbling bytes): 408 once `timeout_s` passes;
- over the app's size limit: aiohttp's 413 (the error middleware words it);
- a lone UTF-16 surrogate in any string (valid JSON, `"\\ud800"`, but not text a tokenizer or a
  response can carry): 400 `invalid_unicode` naming where it is.

The bytes then go to a pydantic model (router/protocol.py), whose JSON parser refuses what is
not JSON, not UTF-8, or nested too deep (400 `invalid_json`).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from aiohttp import web

from router.errors import APIError

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The body's bytes, read within `timeout_s` and free of lone surrogates."""
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except TimeoutError as e:
        raise APIError(
            408, f"the request body did not arrive within {timeout_s:g}s", code="body_timeout"
        ) from e
    # Valid UTF-8 cannot hold a surrogate: only a \uD800-\uDFFF escape makes one, so only a
    # body with such an escape is parsed here and walked (a paired one is fine, and found fine;
    # a body that is not JSON is left to the model's parser to refuse).
    if not _SURROGATE_ESCAPE.search(raw):
        return raw
    try:
        where = surrogate_path(json.loads(raw))
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, digits
        return raw
    if where is not None:
        raise APIError(
            400,
            f"{where} holds a lone UTF-16 surrogate, which is not valid text",
            param=where.split("[")[0].split(".")[0] or None,
            code="invalid_unicode",
        )
    return raw


def surrogate_path(value: Any) -> str | None:
    """Where the first string (or object key) holding a lone surrogate is, as `a.b[2]`, or
    None. Iterative: a deeply nested body must not exhaust the stack here."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not _encodable(v):
                return path or "the body"
        elif isinstance(v, dict):
            for k, sub in v.items():
                key_path = f"{path}.{k}" if path else str(k)
                if not _encodable(k):
                    return path or "a field name"
                stack.append((key_path, sub))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", sub) for i, sub in enumerate(v))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
