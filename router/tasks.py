"""Stopping the router's background tasks for certain.

`task.cancel()` once and `await task` is not enough on Python 3.11: `asyncio.wait_for`
returns its inner result, swallowing the cancellation, when the inner awaitable finishes in
the same loop turn the cancel arrives (CPython gh-86296, fixed in 3.12). A loop that polls
with `wait_for` (the directory refresh, every 0.2 s in tests) then goes on forever and the
`await` never returns; the router's shutdown hung on it once in CI. So cancel again until the
task is done.
"""

from __future__ import annotations

import asyncio
import contextlib

RECANCEL_S = 0.5  # how long one cancellation is given before it is sent again


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel `task` (again if it swallowed the cancel) and wait until it has finished; its
    result or exception, cancellation included, is dropped."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_S)
    with contextlib.suppress(BaseException):
        task.result()
