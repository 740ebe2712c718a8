"""What every fault case shares: a live `tandem serve` started with fault-injection knobs, and
the checks (no wrong answer, no leaked KV block, a clean exit at the end)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

from bench.fault_requests import Tally
from bench.live_server import LiveServer

# Prompts of 8+ tokens take the prefill worker and the KV hand-off (all the cases' prompts):
# by length, the affinity rule. kv-events routing would prefill the cases' prompts, which
# share their first block, on a decode worker that holds it, and the transfer faults below
# would never meet a transfer.
BASE_FLAGS = (
    "--dtype", "float32", "--disagg-threshold", "8", "--log-level", "WARNING",
    "--routing", "affinity",
)  # fmt: skip


@contextlib.contextmanager
def live_server(model: Path, workdir: Path, *flags: str, faults: dict | None = None):
    extra = ("--inject-faults", json.dumps(faults)) if faults else ()
    server = LiveServer(model, workdir, *BASE_FLAGS, *flags, *extra).start()
    try:
        yield server
    finally:
        code = server.stop()
    assert code == 0, f"tandem serve exited with {code}:\n{server.log_text()[-3000:]}"
    assert server.leftovers() == [], "tandem serve left processes behind"


def run(coro):
    return asyncio.run(coro)


def check(tally: Tally, *, correct: int | None = None, errors: int | None = None) -> None:
    """Never a wrong answer, never a leaked block; and the expected split, where given."""
    row = tally.row()
    print(row)  # the per-case outcome, in the test log
    assert row["wrong"] == 0, tally.wrong_details()
    assert row["leaked_blocks"] == 0, row
    if correct is not None:
        assert row["correct"] == correct, row
    if errors is not None:
        assert row["clear_errors"] == errors, row
