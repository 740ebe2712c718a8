"""benchmarks/router_overhead.py: a quick real run (this working tree against itself, so no git
history is needed; about 15 s on an idle 2-core box), the response checker fed answers that
must fail it, and the fake worker refusing to run from the wrong tree."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(REPO))

from benchmarks.router_overhead import Load, cpu_seconds, one_request  # noqa: E402


@pytest.mark.slow
def test_quick_run_streams_every_request_and_measures_both_routers(
    make_tiny_model, tmp_path: Path
) -> None:
    model = make_tiny_model("llama")
    out = tmp_path / "router_overhead.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "router_overhead.py"), "--quick"]
    cmd += ["--old-ref", "WORKTREE", "--model", str(model), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    result = json.loads(out.read_text())
    assert [(r["round"], r["tree"]) for r in result["rounds"]] == [(1, "old"), (1, "new")]
    for r in result["rounds"]:
        assert r["requests"] == r["ok"] == 64 and r["failures"] == 0, (r, log)
        assert r["output_tokens"] == 64 * 64
        assert r["req_per_s"] > 0 and r["router_cpu_s"] > 0 and r["worker_cpu_s"] > 0, r
    for side in ("old", "new"):
        assert Path(result["trees"][side]["path"]) == REPO
        assert result["summary"][side]["router_cpu_us_per_token"] > 0
    assert result["summary"]["ratio_req_per_s"] > 0
    # Both processes of both trees ended on the SIGTERM (a router killed after the grace
    # period would say its shutdown hangs).
    codes = result["exit_codes"]
    assert all(c in (0, -15) for side in codes.values() for c in side), (
        codes,
        result["unclean_exits"],
    )
    assert "new/old: req/s" in proc.stdout


def _sse(chunks: list[dict], done: bool = True) -> str:
    lines = [f"data: {json.dumps(c)}\n\n" for c in chunks]
    return "".join(lines) + ("data: [DONE]\n\n" if done else "")


def _chat_chunks(pieces: list[str], finish: str, completion_tokens: int) -> list[dict]:
    chunks = [{"choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    chunks.append({"choices": [], "usage": {"completion_tokens": completion_tokens}})
    return chunks


def test_checker_accepts_a_whole_stream_and_names_what_is_wrong_with_others() -> None:
    from aiohttp import ClientSession, web

    answers = {
        "good": (200, _sse(_chat_chunks(["Once", " upon"], "length", 2))),
        "short": (200, _sse(_chat_chunks(["Once"], "stop", 1))),
        "text": (200, _sse(_chat_chunks(["Once", " again"], "length", 2))),
        "cut": (200, _sse(_chat_chunks(["Once", " upon"], "length", 2), done=False)),
        "error": (200, _sse([{"error": {"message": "worker failed"}}])),
        "http": (503, json.dumps({"error": {"message": "no workers"}})),
    }

    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        assert body["stream"] and body["max_tokens"] == 2 and body["messages"]
        status, text = answers[body["model"]]
        return web.Response(status=status, text=text, content_type="text/event-stream")

    async def main() -> dict[str, str]:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with ClientSession() as session:
                url = f"http://127.0.0.1:{port}"
                return {
                    name: await one_request(session, url, Load("chat", name, 2, "Once upon"), 0)
                    for name in answers
                }
        finally:
            await runner.cleanup()

    got = asyncio.run(main())
    assert got["good"] == ""
    assert "completion_tokens 1" in got["short"]
    assert "text differs" in got["text"]
    assert "[DONE]" in got["cut"]
    assert "worker failed" in got["error"]
    assert got["http"].startswith("HTTP 503")


def test_fake_worker_refuses_to_run_from_another_tree(tmp_path: Path) -> None:
    # engine comes from this repository (PYTHONPATH), but the worker is told to test another
    # tree: it must exit rather than serve numbers for the wrong code.
    env = dict(os.environ, PYTHONPATH=str(REPO))
    worker = REPO / "benchmarks" / "router_overhead_worker.py"
    cmd = [sys.executable, str(worker), "--tree", str(tmp_path), "--tokens", "1,2"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "TREE MISMATCH" in proc.stderr


def test_cpu_seconds_reads_this_process() -> None:
    before = cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))  # ~0.1 s of CPU, well over one clock tick
    assert cpu_seconds(os.getpid()) > before >= 0
