"""The bench client end to end against a real aiohttp OpenAI-style streaming server.

The server (a test seam beside the real path, not a stand-in for tandem) runs on 127.0.0.1 in
its own thread and event loop. It waits `ttft_s`, then streams one token, then chunks of
`tokens_per_chunk` tokens every `chunk_gap_s`, then (when asked) a usage chunk and [DONE];
selected requests, by the order they reach it, get an HTTP 500 or a dropped connection."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import numpy as np
import pytest
from aiohttp import web

from bench.client import run_benchmark
from bench.config import CHAT, BenchConfig
from bench.plots import TIMELINE, TPOT_CDF, TTFT_CDF
from bench.report import BenchResult, finish
from cluster import cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass
class Plan:
    ttft_s: float = 0.05
    chunk_gap_s: float = 0.02
    tokens_per_chunk: int = 1
    send_usage: bool = True
    prompt_tokens_bonus: int = 0  # the usage's prompt_tokens exceeds what was sent by this
    failures: dict[int, str] = field(default_factory=dict)  # arrival order -> "500" | "drop"
    payloads: list[dict] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


class StubServer:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def __enter__(self) -> Self:
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub-model"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        plan = self.plan
        body = await request.json()
        order = len(plan.payloads)
        plan.payloads.append(body)
        plan.auth.append(request.headers.get("Authorization"))
        mode = plan.failures.get(order)
        if mode == "500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        plan.in_flight += 1
        plan.max_in_flight = max(plan.max_in_flight, plan.in_flight)
        try:
            return await self._stream(request, body, mode)
        finally:
            plan.in_flight -= 1

    async def _stream(self, request: web.Request, body: dict, mode: str | None):
        plan = self.plan
        chat = "messages" in body
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        total = body["max_tokens"]
        sizes = [1]
        while sum(sizes) < total:
            sizes.append(min(plan.tokens_per_chunk, total - sum(sizes)))
        await asyncio.sleep(plan.ttft_s)
        for i, k in enumerate(sizes):
            if i:
                await asyncio.sleep(plan.chunk_gap_s)
            if mode == "drop" and i == 2:
                request.transport.close()  # the server dies mid-stream
                return resp
            text = "x" * k
            choice = (
                {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            )
            choice["finish_reason"] = "length" if i == len(sizes) - 1 else None
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        if plan.send_usage and body.get("stream_options", {}).get("include_usage"):
            if chat:
                prompt_len = len(body["messages"][0]["content"].split())
            else:
                prompt_len = len(body["prompt"])
            usage = {
                "prompt_tokens": prompt_len + plan.prompt_tokens_bonus,
                "completion_tokens": total,
                "total_tokens": prompt_len + total,
            }
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def test_completions_timing_failures_json_and_plots(tmp_path: Path):
    plan = Plan(ttft_s=0.05, chunk_gap_s=0.02, failures={3: "500", 7: "drop"})
    with StubServer(plan) as server:
        cfg = BenchConfig(
            base_url=server.url,
            num_prompts=12,
            input_len=32,
            input_range=0.5,
            output_len=8,
            request_rate=200.0,
            max_concurrency=4,
            seed=1,
            slo_ttft_ms=10_000.0,
            slo_tpot_ms=5.0,
            api_key="sk-test",
            vocab_low=10,
            vocab_high=50,
            progress=False,
            result_json=str(tmp_path / "r.json"),
            plot_dir=str(tmp_path / "plots"),
        )
        result = asyncio.run(run_benchmark(cfg))
    finish(result)
    m = result.metrics
    # Failures are counted and kept out of the latencies.
    assert (m.completed, m.failed) == (10, 2)
    errors = " | ".join(result.errors)
    assert "HTTP 500" in errors and sum(result.errors.values()) == 2
    assert m.ttft_ms.count == 10 and m.e2e_ms.count == 10

    # What the server received: exact token-id prompts, exact output lengths, the key.
    assert len(plan.payloads) == 12 and plan.max_in_flight <= 4
    assert result.model == "stub-model"
    for body in plan.payloads:
        assert body["model"] == "stub-model" and body["max_tokens"] == 8
        assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0.0
        assert body["stream_options"] == {"include_usage": True}
        assert 16 <= len(body["prompt"]) <= 48
        assert all(isinstance(t, int) and 10 <= t < 50 for t in body["prompt"])
    assert set(plan.auth) == {"Bearer sk-test"}

    _check_timings_against_server_and_records(result, plan)
    _check_json_and_plots(tmp_path)


def _check_timings_against_server_and_records(result: BenchResult, plan: Plan) -> None:
    """Every number is consistent with the server's behaviour and with the records; how fast
    the machine is never matters (speed belongs in benchmarks/)."""
    m = result.metrics
    ok = [r for r in result.records if r.ok]
    assert len(ok) == 10
    for r in ok:
        assert r.output_len == 8 and len(r.itls_s) == 7
        # No token can arrive before the server's injected delay (1 ms of timer granularity).
        assert r.ttft_s >= plan.ttft_s - 0.001
        # The server sleeps ttft + 7 chunk gaps on every stream after it reads the request.
        assert r.e2e_s >= plan.ttft_s + 7 * plan.chunk_gap_s - 0.002
        assert 0 < r.ttft_s <= r.e2e_s
        assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 7)
        assert all(itl >= 0 for itl in r.itls_s)
        # The ITLs span first to last content chunk, which lies within TTFT..E2E.
        assert sum(r.itls_s) <= r.e2e_s - r.ttft_s + 1e-9
        # Arrivals keep their schedule: nothing is sent before it arrives.
        assert r.start_s >= r.arrival_s - 0.005
        assert r.start_s + r.e2e_s <= m.duration_s
    ms = 1000.0
    assert m.ttft_ms.mean == pytest.approx(ms * sum(r.ttft_s for r in ok) / 10)
    assert m.tpot_ms.count == 10
    assert m.tpot_ms.p50 == pytest.approx(ms * float(np.median([r.tpot_s for r in ok])))
    itls = [x for r in ok for x in r.itls_s]
    assert m.itl_ms.count == 70 and m.itl_ms.mean == pytest.approx(ms * sum(itls) / 70)
    assert m.e2e_ms.p99 == pytest.approx(ms * float(np.percentile([r.e2e_s for r in ok], 99)))
    assert m.output_tok_s == pytest.approx(10 * 8 / m.duration_s)
    assert m.duration_s >= plan.ttft_s + 7 * plan.chunk_gap_s
    # Goodput counts exactly the completed requests within both SLOs.
    good = sum(r.ttft_s * ms <= 10_000.0 and r.tpot_s * ms <= 5.0 for r in ok)
    assert m.good_requests == good and m.goodput_rps == pytest.approx(good / m.duration_s)


def _check_json_and_plots(tmp_path: Path) -> None:
    data = json.loads((tmp_path / "r.json").read_text())
    for key in (
        "completed",
        "failed",
        "duration_s",
        "request_rate",
        "output_tok_s",
        "goodput_rps",
        "requests",
        "config",
    ):
        assert key in data
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(data[key]) >= {"mean", "p50", "p90", "p99"}
    assert (data["completed"], data["failed"], data["request_rate"]) == (10, 2, 200.0)
    assert len(data["requests"]) == 12
    assert sum(1 for r in data["requests"] if r["error"]) == 2
    assert data["config"]["api_key"] == "<redacted>"
    assert "sk-test" not in (tmp_path / "r.json").read_text()
    for name in (TTFT_CDF, TPOT_CDF, TIMELINE):
        png = tmp_path / "plots" / name
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000


def test_chat_multi_token_chunks_are_spread_and_usage_is_believed():
    plan = Plan(ttft_s=0.03, chunk_gap_s=0.04, tokens_per_chunk=2, prompt_tokens_bonus=3)
    with StubServer(plan) as server:
        cfg = BenchConfig(
            base_url=server.url,
            endpoint=CHAT,
            model="named",
            num_prompts=4,
            input_len=10,
            output_len=9,
            request_rate=math_inf(),
            progress=False,
        )
        result = asyncio.run(run_benchmark(cfg))
    assert result.metrics.completed == 4
    assert len(plan.payloads) == 4 and len(result.records) == 4
    for body in plan.payloads:
        assert body["model"] == "named" and len(body["messages"][0]["content"].split()) == 10
    for r in result.records:
        # 1 token, then 4 chunks of 2 tokens: 8 ITLs, each chunk's gap split over its tokens.
        assert r.output_len == 9 and len(r.itls_s) == 8
        assert r.prompt_len == 13  # the usage chunk's count, not the requested one
        assert r.ttft_s >= plan.ttft_s - 0.001
        assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 8)
        for a, b in zip(r.itls_s[0::2], r.itls_s[1::2], strict=True):
            assert a == pytest.approx(b)  # one chunk's gap, split in two
    itls = [x for r in result.records for x in r.itls_s]
    assert result.metrics.itl_ms.count == 32
    assert result.metrics.itl_ms.p50 == pytest.approx(1000.0 * float(np.median(itls)))


def test_without_usage_tokens_are_counted_from_chunks():
    plan = Plan(ttft_s=0.01, chunk_gap_s=0.01, tokens_per_chunk=2, send_usage=False)
    with StubServer(plan) as server:
        cfg = BenchConfig(
            base_url=server.url, num_prompts=3, input_len=4, output_len=5, progress=False
        )
        result = asyncio.run(run_benchmark(cfg))
    # Chunks of 1, 2, 2 tokens and no usage: three chunks count as three tokens.
    assert [r.output_len for r in result.records] == [3, 3, 3]
    assert all(len(r.itls_s) == 2 for r in result.records)


def test_unreachable_server_fails_every_request():
    cfg = BenchConfig(
        base_url="http://127.0.0.1:9",
        num_prompts=3,
        input_len=4,
        output_len=2,
        progress=False,
        request_timeout_s=5.0,
    )
    result = asyncio.run(run_benchmark(cfg))
    assert (result.metrics.completed, result.metrics.failed) == (0, 3)
    json.loads(result.to_json())


def test_cli_replays_a_scaled_trace(tmp_path: Path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,400,30\n"
        "2023-11-16 18:17:04.0799600,200,50\n"
        "2023-11-16 18:17:04.2799600,60,20\n"
        "2023-11-16 18:17:09.0000000,10,10\n"
    )
    plan = Plan(ttft_s=0.01, chunk_gap_s=0.005)
    out = tmp_path / "out.json"
    with StubServer(plan) as server:
        rc = cli.main(
            [
                "bench",
                "serve",
                "--base-url",
                server.url,
                "--dataset",
                f"trace:{trace}",
                "--num-prompts",
                "3",
                "--trace-length-scale",
                "0.1",
                "--trace-time-scale",
                "2",
                "--trace-max-output",
                "4",
                "--no-progress",
                "--result-json",
                str(out),
                "--plot-dir",
                str(tmp_path / "p"),
            ]
        )
    assert rc == 0
    assert [len(b["prompt"]) for b in plan.payloads] == [40, 20, 6]
    assert [b["max_tokens"] for b in plan.payloads] == [3, 4, 2]
    data = json.loads(out.read_text())
    assert data["completed"] == 3 and data["failed"] == 0
    assert data["trace"]["length_scale"] == 0.1 and data["trace"]["time_scale"] == 2.0
    assert data["trace"]["max_output"] == 4 and data["arrivals"] == "trace"
    assert [r["arrival_s"] for r in data["requests"]] == pytest.approx([0.0, 0.2, 0.6])
    assert data["request_rate"] == pytest.approx(2 / 0.6)
    report = capsys.readouterr().out
    assert "length scale / time scale:" in report and "0.1 / 2" in report
    assert (tmp_path / "p" / TIMELINE).exists()


def math_inf() -> float:
    return float("inf")
