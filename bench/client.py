"""The streaming client of `tandem bench serve`: `run_benchmark(config)` sends the workload to
an OpenAI-compatible server and returns a `BenchResult`; nothing is printed or written.

Lifecycle of a run:
1. workload: built up front from the config and its seed (`bench/workload.py`), once the
   model is known (a ShareGPT run counts tokens with its tokenizer);
2. dispatch: each request is started at its arrival offset; --max-concurrency holds it in a
   semaphore until a slot frees (arrivals keep their schedule; the wait is recorded as the
   gap between arrival_s and start_s and drawn on the timeline, while TTFT and E2E are timed
   from the send, as vLLM does);
3. stream: one aiohttp POST with `stream: true`, `stream_options.include_usage`, `ignore_eos`
   and `max_tokens`; each SSE content chunk's arrival is a token timestamp, the usage chunk
   gives the token count (see bench/metrics.py for how multi-token chunks count);
   HTTP errors, error events, disconnects and streams that end without `[DONE]` or a
   finish_reason are failures, kept with their error and left out of every latency;
4. metrics over the records (`bench/metrics.py`); `bench/report.py` prints and writes them.

aiohttp is used rather than the openai client so every timestamp is taken as the bytes arrive
and any server works, including ones that only speak the wire format.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

import aiohttp
from tqdm import tqdm

from bench.config import CHAT, COMPLETIONS, BenchConfig
from bench.metrics import RequestRecord, compute_metrics, measure_request
from bench.report import BenchResult
from bench.workload import WorkloadRequest, build_workload


def endpoint_url(base_url: str, endpoint: str) -> str:
    """Join base and endpoint; a base that already ends in /v1 is accepted too."""
    base = base_url.rstrip("/")
    if base.endswith("/v1") and endpoint.startswith("/v1/"):
        base = base[: -len("/v1")]
    return base + endpoint


def build_payload(config: BenchConfig, req: WorkloadRequest, model: str | None) -> dict:
    payload: dict = {
        "max_tokens": req.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        payload["ignore_eos"] = True
    if model is not None:
        payload["model"] = model
    if config.endpoint == COMPLETIONS:
        payload["prompt"] = req.prompt
    else:
        payload["messages"] = [{"role": "user", "content": req.prompt}]
    return payload


_JSON = {"Content-Type": "application/json"}


class RequestFailed(Exception):
    """A request the server answered badly (status, error event, truncated stream)."""


@dataclass(slots=True)
class _Stream:
    chunk_times: list[float] = field(default_factory=list)
    usage_output: int | None = None
    usage_prompt: int | None = None
    finished: bool = False  # [DONE] or a finish_reason seen
    end: float = 0.0


def _chunk_text(chunk: dict, chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if chat:
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def _read_stream(resp: aiohttp.ClientResponse, chat: bool) -> _Stream:
    """Consume SSE `data:` lines (one JSON event per line, as OpenAI servers send them)."""
    s = _Stream()
    async for raw in resp.content:
        now = time.perf_counter()
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, `: keep-alive` comments, `event:` lines
        data = line[len(b"data:") :].strip()
        if data == b"[DONE]":
            s.finished = True
            s.end = now
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RequestFailed(f"error event: {json.dumps(chunk['error'])[:300]}")
        if _chunk_text(chunk, chat):
            s.chunk_times.append(now)
        for choice in chunk.get("choices") or []:
            if choice.get("finish_reason"):
                s.finished = True
        usage = chunk.get("usage")
        if usage:
            s.usage_output = usage.get("completion_tokens", s.usage_output)
            s.usage_prompt = usage.get("prompt_tokens", s.usage_prompt)
        s.end = now
    return s


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    chat: bool,
    record: RequestRecord,
    t0: float,
) -> None:
    start = time.perf_counter()
    record.start_s = max(0.0, start - t0)
    try:
        async with session.post(url, data=body, headers=_JSON) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300].strip()
                raise RequestFailed(f"HTTP {resp.status}: {body}")
            s = await _read_stream(resp, chat)
        if not s.finished:
            raise RequestFailed("stream ended before [DONE] or a finish_reason")
        if not s.chunk_times:
            raise RequestFailed("stream carried no content")
        timing = measure_request(
            start, s.chunk_times, max(s.end, s.chunk_times[-1]), s.usage_output
        )
    except asyncio.CancelledError:
        raise
    except TimeoutError:
        record.error = f"timeout after {session.timeout.total:g} s"
        return
    except RequestFailed as exc:
        record.error = str(exc)
        return
    except Exception as exc:  # noqa: BLE001 -- one bad request must not end the run: it is counted
        record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return
    record.ttft_s = timing.ttft_s
    record.e2e_s = timing.e2e_s
    record.itls_s = timing.itls_s
    record.output_len = timing.output_len
    if s.usage_prompt is not None:
        record.prompt_len = s.usage_prompt


async def resolve_model(session: aiohttp.ClientSession, base_url: str) -> str | None:
    """The first model the server lists, or None when it lists none (then no model is sent)."""
    try:
        # A short limit of its own: a server without this route must not stall the start.
        async with session.get(
            endpoint_url(base_url, "/v1/models"), timeout=aiohttp.ClientTimeout(total=10)
        ) as resp:
            if resp.status != 200:
                return None
            data = (await resp.json(content_type=None)).get("data") or []
            return data[0].get("id") if data else None
    except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
        return None


def _session(config: BenchConfig) -> aiohttp.ClientSession:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # aiohttp caps a session at 100 connections by default, which would silently act as a
    # concurrency limit; the semaphore in `_dispatch` is the only limit.
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers)


async def _dispatch(
    config: BenchConfig,
    session: aiohttp.ClientSession,
    model: str | None,
    requests: list[WorkloadRequest],
    records: list[RequestRecord],
) -> float:
    """Start each request at its arrival offset, wait for all; return the run's duration."""
    sem = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    chat = config.endpoint == CHAT
    url = endpoint_url(config.base_url, config.endpoint)
    bar = tqdm(
        total=len(records),
        disable=not config.progress,
        unit="req",
        desc="bench serve",
        file=sys.stderr,
    )

    async def one(req: WorkloadRequest, record: RequestRecord, t0: float) -> None:
        # Encoded before the clock starts: a long prompt's JSON is not the server's time.
        body = json.dumps(build_payload(config, req, model)).encode()
        if sem is None:
            await _send(session, url, body, chat, record, t0)
        else:
            async with sem:
                await _send(session, url, body, chat, record, t0)
        bar.update(1)

    t0 = time.perf_counter()
    tasks = []
    for req, record in zip(requests, records, strict=False):
        delay = t0 + req.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req, record, t0)))
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        bar.close()
    return time.perf_counter() - t0


async def run_benchmark(config: BenchConfig) -> BenchResult:
    """Run the whole benchmark in the caller's event loop and return its result (nothing is
    printed or written; `bench.report.finish` does that)."""
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    async with _session(config) as session:
        model = config.model or await resolve_model(session, config.base_url)
        workload = build_workload(config, tokenizer=model)
        records = [
            RequestRecord(r.index, r.arrival_s, r.arrival_s, r.prompt_len, r.output_len)
            for r in workload.requests
        ]
        duration = await _dispatch(config, session, model, workload.requests, records)
    slos = config.slos
    metrics = compute_metrics(
        records,
        duration,
        slos.get("ttft"),
        slos.get("tpot"),
        slo_e2el_ms=slos.get("e2el"),
        slo_ttft_ms_per_1k=config.slo_ttft_ms_per_1k,
    )
    errors = collections.Counter(r.error for r in records if r.error is not None)
    return BenchResult(
        config, metrics, records, model, started_at, workload.trace, dict(errors.most_common())
    )
