"""router.tasks.cancel_and_wait: a task that swallows a cancellation (as Python 3.11's
`asyncio.wait_for` does when its inner awaitable finishes in the same turn) is still stopped."""

from __future__ import annotations

import asyncio

from router.tasks import cancel_and_wait


def test_a_task_that_swallows_one_cancel_is_still_stopped():
    swallowed = []

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(True)  # lost, as wait_for loses it on 3.11

    async def main() -> None:
        task = asyncio.create_task(stubborn())
        await asyncio.sleep(0)
        await asyncio.wait_for(cancel_and_wait(task), timeout=5)
        assert task.cancelled() and swallowed == [True]

    asyncio.run(main())


def test_finished_failed_and_missing_tasks_are_fine():
    async def boom() -> None:
        raise ValueError("boom")

    async def main() -> None:
        await cancel_and_wait(None)
        task = asyncio.create_task(boom())
        await asyncio.sleep(0)
        await cancel_and_wait(task)  # its exception is dropped, not raised
        assert task.done()

    asyncio.run(main())
