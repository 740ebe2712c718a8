"""Readiness, liveness, drain and which routes ask for the API key, on a real router (real
HTTP, real ZMQ) with fake workers."""

from __future__ import annotations

import asyncio
import hmac
import json
import time

import aiohttp
from router_fakes import FakeWorker, HoldingWorker, echo_tokens

import router.server as server_module
from router.errors import UNAVAILABLE_RETRY_AFTER_S


async def until(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def get(s: aiohttp.ClientSession, url: str, **kw) -> tuple[int, dict, str | None]:
    async with s.get(url, **kw) as r:
        text = await r.text()
        body = json.loads(text) if r.content_type == "application/json" else {"text": text}
        return r.status, body, r.headers.get("Retry-After")


async def post(s: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict, str | None]:
    async with s.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json(content_type=None), r.headers.get("Retry-After")


async def on_loop(h, coro):
    """Run a coroutine on the router's own loop (its thread) and await it from this one."""
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, h.loop))


def metric(text: str, name: str, labels: str) -> float:
    needle = f"{name}{{{labels}}} "
    return float(next(line for line in text.splitlines() if line.startswith(needle)).split()[-1])


def test_ready_needs_a_decode_capable_worker(make_router):
    prefill = FakeWorker("p0", "prefill")
    h = make_router(workers=[prefill], refresh_interval_s=0.1)
    url = h.base_url

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            for path in ("/ready", "/health?ready=1"):
                status, body, retry_after = await get(s, url + path)
                assert status == 503 and retry_after == str(UNAVAILABLE_RETRY_AFTER_S)
                assert body["status"] == "not_ready" and body["reason"] == "no_decode_workers"
                assert body["workers"] == {"prefill": 1}
            status, body, _ = await get(s, url + "/health")  # liveness does not care
            assert status == 200 and body["status"] == "ok" and body["draining"] is False
            for role in ("decode", "colocated"):
                worker = FakeWorker(f"{role}0", role)
                h.workers.append(worker)  # the harness closes it
                h.directory.set_workers([prefill.info(), worker.info()])
                await until(lambda r=role: r in h.server.pool.role_counts())
                for path in ("/ready", "/health?ready=1"):
                    status, body, _ = await get(s, url + path)
                    assert status == 200, body
                    assert body == {"status": "ready", "workers": {"prefill": 1, role: 1}}
            h.directory.set_workers([])
            await until(lambda: not h.server.pool.workers)
            assert (await get(s, url + "/ready"))[0] == 503

    asyncio.run(go())


def test_drain_refuses_new_requests_and_lets_in_flight_ones_finish(make_router, model_info):
    worker = HoldingWorker("d0", delay_s=0.02)
    h = make_router(workers=[worker])
    url, server = h.base_url, h.server
    tok = model_info.tokenizer
    expected = tok.decode(echo_tokens([5, 6, 7], 8))

    async def stream(s: aiohttp.ClientSession) -> tuple[int, list[str]]:
        body = {"prompt": [5, 6, 7], "max_tokens": 8, "stream": True}
        async with s.post(url + "/v1/completions", json=body) as r:
            raw = (await r.read()).decode()
            return r.status, [e[len("data: ") :] for e in raw.split("\n\n") if e]

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            assert await on_loop(h, server.wait_idle(0.1))  # nothing in flight
            streamed = asyncio.create_task(stream(s))
            whole = asyncio.create_task(post(s, url, {"prompt": [5, 6, 7], "max_tokens": 8}))
            await until(lambda: server.admission.queued_requests == 2)
            h.loop.call_soon_threadsafe(server.begin_drain)
            h.loop.call_soon_threadsafe(server.begin_drain)  # idempotent
            await until(lambda: server.draining)
            status, body, retry_after = await post(s, url, {"prompt": [5], "max_tokens": 2})
            assert status == 503 and body["error"]["code"] == "draining"
            assert retry_after == str(UNAVAILABLE_RETRY_AFTER_S)
            status, body, retry_after = await get(s, url + "/ready")
            assert status == 503 and body["reason"] == "draining" and retry_after
            status, body, _ = await get(s, url + "/health")
            assert status == 200 and body["draining"] is True
            assert not await on_loop(h, server.wait_idle(0.3))  # two requests still held
            worker.release()
            status, events = await streamed
            assert status == 200 and events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert "".join(c["choices"][0]["text"] for c in chunks) == expected
            status, body, _ = await whole
            assert status == 200 and body["choices"][0]["text"] == expected
            assert await on_loop(h, server.wait_idle(5.0))
            status, text, _ = await get(s, url + "/metrics")
            rejected = metric(text["text"], "tandem_requests_rejected_total", 'reason="draining"')
            assert rejected == 1
            # Only generation requests are refused: the rest of the API still answers.
            assert (await get(s, url + "/v1/models"))[0] == 200

    asyncio.run(go())
    assert server._active == 0 and server.admission.queued_requests == 0


def test_probes_are_open_and_metrics_follow_metrics_require_key(make_router, monkeypatch):
    compared: list[bytes] = []
    real_compare = hmac.compare_digest

    def spy(a, b):
        compared.append(a)
        return real_compare(a, b)

    # The key check stays a constant-time comparison.
    monkeypatch.setattr(server_module.hmac, "compare_digest", spy)
    closed = make_router(api_key="sekret")
    open_metrics = make_router(api_key="sekret", metrics_require_key=False)
    key = {"Authorization": "Bearer sekret"}
    wrong = {"Authorization": "Bearer sekreT"}

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            for h in (closed, open_metrics):
                for path in ("/health", "/ready", "/health?ready=1"):
                    assert (await get(s, h.base_url + path))[0] == 200, path
                status, body, _ = await get(s, h.base_url + "/v1/models")
                assert status == 401 and body["error"]["code"] == "invalid_api_key"
                assert (await get(s, h.base_url + "/v1/models", headers=wrong))[0] == 401
                assert (await get(s, h.base_url + "/metrics", headers=key))[0] == 200
            assert (await get(s, closed.base_url + "/metrics"))[0] == 401
            assert (await get(s, closed.base_url + "/metrics", headers=wrong))[0] == 401
            status, body, _ = await get(s, open_metrics.base_url + "/metrics")
            assert status == 200 and "tandem_router_queued_requests" in body["text"]

    asyncio.run(go())
    assert b"Bearer sekreT" in compared and b"Bearer sekret" in compared
