"""Graceful drain: SIGTERM on `tandem serve` lets in-flight requests finish while new ones get
503 with Retry-After, then exits 0 leaving no process; one worker drained out of a live
deployment (the planner's scale-down) finishes what it holds and no request is lost."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from fault_helpers import live_server

from bench import fault_cases as fc
from bench import fault_requests as fr

HERE = Path(__file__).resolve().parent


async def _sigterm_under_load(server, n: int, max_tokens: int):
    texts = fc.prompts(n)
    refs = await fc.references(server.url, texts, max_tokens)
    async with fr.session(120) as s:
        tasks, started = fc.launch_streams(s, server.url, texts, refs, max_tokens, 90)
        await fc.wait_started(started, tasks, 10.0)
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        body = fr.completion_body(texts[0], 4, False)
        async with s.post(server.url + "/v1/completions", json=body) as resp:
            late = (resp.status, resp.headers.get("Retry-After"), await resp.json())
        return await asyncio.gather(*tasks), late


def test_sigterm_drains_in_flight_requests_then_exits_clean(fault_model, tmp_path):
    faults = {"decode": {"step_delay_s": 0.01}}
    with live_server(fault_model, tmp_path, faults=faults) as server:
        outcomes, late = asyncio.run(_sigterm_under_load(server, 4, 150))
        server.proc.wait(60)
    assert [o.kind for o in outcomes] == [fr.CORRECT] * 4, outcomes
    status, retry_after, body = late
    assert status == 503 and body["error"]["code"] == "draining", late
    assert retry_after is not None and int(retry_after) >= 1
    log = server.log_text()
    assert "tandem: drained" in log, log[-2000:]


def test_drain_one_worker_out_of_a_live_deployment(fault_model):
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(HERE / "drain_driver.py"), str(fault_model)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=HERE.parents[1],
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    kinds = [o[0] for o in result["outcomes"]]
    assert kinds == [fr.CORRECT] * len(kinds), result["outcomes"]
    assert result["drained"]["idle"] is True, result["drained"]
    assert result["left"] == ["decode-0", "prefill-0"]
    assert set(result["leaked"].values()) == {0}, result["leaked"]
    print(f"drain case took {time.monotonic() - t0:.1f}s: {result['drained']}")
