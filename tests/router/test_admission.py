"""Bounded admission: AdmissionControl's arithmetic on a test clock, then the real router (real
HTTP, real ZMQ, fake workers that hold their first token) answering 429 with Retry-After."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from router_fakes import FakeWorker, HoldingWorker, echo_tokens

from engine.protocol import GenerateRequest
from router.admission import AdmissionControl
from router.errors import UNAVAILABLE_RETRY_AFTER_S, APIError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------- AdmissionControl


def test_request_limit_and_ticket_lifecycle():
    ac = AdmissionControl(2, 0)
    a, b = ac.admit("a", 5), ac.admit("b", 7)
    assert (ac.queued_requests, ac.queued_prompt_tokens) == (2, 12)
    with pytest.raises(APIError) as e:
        ac.admit("c", 1)
    assert (e.value.status, e.value.code, e.value.retry_after) == (429, "queue_full", 1)
    assert e.value.headers == {"Retry-After": "1"}  # no departure observed yet
    a.started()  # first token: leaves the queue, the request goes on
    assert (ac.queued_requests, ac.queued_prompt_tokens) == (1, 7)
    c = ac.admit("c", 1)
    a.done()
    a.done()
    b.done()
    b.done()  # idempotent, whether it started or not
    b.started()  # a late first token after the end changes nothing
    assert (ac.queued_requests, ac.queued_prompt_tokens) == (1, 1)
    c.done()
    assert (ac.queued_requests, ac.queued_prompt_tokens) == (0, 0)


def test_token_limit_boundary_and_big_prompt():
    ac = AdmissionControl(0, 10)
    a, b = ac.admit("a", 6), ac.admit("b", 4)  # exactly at the limit
    with pytest.raises(APIError, match="prompt tokens waiting"):
        ac.admit("c", 1)
    a.done()
    b.done()
    big = ac.admit("big", 50)  # over the limit alone, but nothing waits: admitted
    with pytest.raises(APIError):
        ac.admit("d", 1)
    big.started()
    ac.admit("d", 1)


def test_zero_means_unlimited():
    ac = AdmissionControl(0, 0)
    for i in range(1000):
        ac.admit(str(i), 1 << 20)
    assert ac.queued_requests == 1000


def test_retry_after_follows_the_observed_service_rate():
    clock = Clock()
    ac = AdmissionControl(2, 0, clock=clock)
    a = ac.admit("a", 1000)
    ac.admit("b", 1000)
    clock.now = 1.0
    a.started()  # 1000 tokens served in 1 busy second
    assert ac.service_rate() == pytest.approx(1000.0)
    ac.admit("c", 4000)  # queued: 1000 + 4000 tokens
    with pytest.raises(APIError) as e:
        ac.admit("d", 1)
    assert e.value.retry_after == 5  # 5000 tokens at 1000 tokens/s
    # A stall with requests waiting lowers the rate as it lasts; the answer is clamped at 60.
    clock.now = 11.0
    assert ac.service_rate() < 100
    assert ac.retry_after_s() == 60


def test_idle_time_is_not_service_time():
    clock = Clock()
    ac = AdmissionControl(1, 0, clock=clock)
    a = ac.admit("a", 1000)
    clock.now = 0.5
    a.started()  # 2000 tokens/s while busy
    clock.now = 100.0  # idle for a long while
    ac.admit("b", 4000)
    with pytest.raises(APIError) as e:
        ac.admit("c", 1)
    assert e.value.retry_after == 2


def test_fast_service_clamps_to_one_second_and_bad_limits_are_refused():
    clock = Clock()
    ac = AdmissionControl(1, 0, clock=clock)
    a = ac.admit("a", 10**6)
    clock.now = 0.001
    a.started()
    ac.admit("b", 10)
    assert ac.retry_after_s() == 1
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="max_queued_requests"):
            AdmissionControl(bad, 0)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="max_queued_prompt_tokens"):
            AdmissionControl(0, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prompt_tokens"):
        AdmissionControl(0, 0).admit("x", -1)


def test_every_503_carries_retry_after():
    assert APIError(503, "x", code="worker_abort").headers == {
        "Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)
    }
    resp = APIError(503, "x", code="no_workers", retry_after=7).response()
    assert resp.headers["Retry-After"] == "7"
    assert "Retry-After" not in APIError(500, "x").response().headers


# ---------------------------------------------------------------------------- over HTTP


def metric(text: str, name: str, labels: str = "") -> float:
    needle = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(needle + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{needle} not in metrics")


def wait_for(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.02)
    return bool(cond())


async def until(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def complete(s: aiohttp.ClientSession, url: str, prompt: list[int], n: int, **extra):
    body = {"prompt": prompt, "max_tokens": n, **extra}
    async with s.post(url + "/v1/completions", json=body) as r:
        return r.status, r.headers.get("Retry-After"), await r.json(content_type=None)


async def metrics_text(s: aiohttp.ClientSession, url: str) -> str:
    async with s.get(url + "/metrics") as r:
        return await r.text()


def test_full_queue_answers_429_fast_and_admitted_requests_complete(make_router, model_info):
    worker = HoldingWorker("d0")
    h = make_router(workers=[worker], max_queued_requests=2)
    url, admission = h.base_url, h.server.admission
    tok = model_info.tokenizer

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            held = [asyncio.create_task(complete(s, url, [5, 6, 7], 4)) for _ in range(2)]
            await until(lambda: admission.queued_requests == 2)
            took = []
            for _ in range(3):
                t0 = time.monotonic()
                status, retry_after, body = await complete(s, url, [5, 6, 7], 4)
                took.append(time.monotonic() - t0)
                assert status == 429 and 1 <= int(retry_after) <= 60
                err = body["error"]
                assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
                assert "queue is full" in err["message"] and "param" in err
            # Not waiting on the held worker (the harness's worker timeouts are seconds).
            assert min(took) < 0.1 and max(took) < 2.0, took
            text = await metrics_text(s, url)
            assert metric(text, "tandem_router_queued_requests") == 2
            assert metric(text, "tandem_router_queued_prompt_tokens") == 6
            assert metric(text, "tandem_requests_rejected_total", 'reason="queue_full"') == 3
            assert metric(text, "tandem_requests_total", 'status="client_error"') == 3
            worker.release()
            for status, _, body in await asyncio.gather(*held):
                assert status == 200
                assert body["choices"][0]["text"] == tok.decode(echo_tokens([5, 6, 7], 4))
            assert (await complete(s, url, [5, 6], 2))[0] == 200
            text = await metrics_text(s, url)
            assert metric(text, "tandem_router_queued_requests") == 0
            assert metric(text, "tandem_router_queued_prompt_tokens") == 0

    asyncio.run(go())
    assert len(worker.received) == 3  # the refused requests never reached a worker


def test_prompt_token_limit(make_router):
    worker = HoldingWorker("d0")
    h = make_router(workers=[worker], max_queued_requests=0, max_queued_prompt_tokens=10)
    url, admission = h.base_url, h.server.admission

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            held = [
                asyncio.create_task(complete(s, url, list(range(5, 11)), 2)),  # 6 tokens
                asyncio.create_task(complete(s, url, [5, 6, 7, 8], 2)),  # 4: exactly at 10
            ]
            await until(lambda: admission.queued_prompt_tokens == 10)
            status, retry_after, body = await complete(s, url, [5], 2)
            assert status == 429 and retry_after is not None
            assert body["error"]["code"] == "queue_full"
            worker.release()
            assert [r[0] for r in await asyncio.gather(*held)] == [200, 200]
            assert admission.queued_prompt_tokens == 0

    asyncio.run(go())


def test_a_prompt_over_the_token_limit_is_admitted_alone(make_router):
    worker = HoldingWorker("d0")
    h = make_router(workers=[worker], max_queued_prompt_tokens=10)
    url, admission = h.base_url, h.server.admission

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            big = asyncio.create_task(complete(s, url, [5] * 20, 2))
            await until(lambda: admission.queued_prompt_tokens == 20)
            assert (await complete(s, url, [5], 2))[0] == 429
            worker.release()
            assert (await big)[0] == 200
            assert (await complete(s, url, [5], 2))[0] == 200

    asyncio.run(go())


def test_first_token_frees_the_queue_slot(make_router):
    # After the release the worker sends one token every 0.3 s: the held stream runs for
    # seconds after its first token, while its queue slot is already free.
    worker = HoldingWorker("d0", delay_s=0.3)
    h = make_router(workers=[worker], max_queued_requests=1)
    url, admission = h.base_url, h.server.admission

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            body = {"prompt": [5, 6, 7], "max_tokens": 30, "stream": True}

            async def open_stream() -> aiohttp.ClientResponse:
                # Returns with the headers, which a stream sends with its first token.
                return await s.post(url + "/v1/completions", json=body)

            opened = asyncio.create_task(open_stream())
            await until(lambda: admission.queued_requests == 1)
            assert (await complete(s, url, [5], 1))[0] == 429
            worker.release()
            stream = await opened
            try:
                assert stream.status == 200 and (await stream.content.readline()).strip()
                await until(lambda: admission.queued_requests == 0)
                assert not stream.content.at_eof()  # still generating
                assert (await complete(s, url, [5], 1))[0] == 200  # admitted beside it
            finally:
                stream.close()  # hang up: the stream's request ends and is aborted
        await until(lambda: admission.queued_requests == 0 and h.server._active == 0)

    async def run() -> None:
        await asyncio.wait_for(go(), 30)

    asyncio.run(run())
    assert wait_for(lambda: worker.aborts)


def test_ticket_released_on_disconnect_error_and_503(make_router):
    held = HoldingWorker("d0")
    h = make_router(workers=[held])

    async def disconnect() -> None:
        async with aiohttp.ClientSession() as s:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(complete(s, h.base_url, [5, 6], 3), 0.5)
        await until(lambda: h.server.admission.queued_requests == 0)

    asyncio.run(disconnect())
    assert h.server.admission.queued_prompt_tokens == 0 and h.server._active == 0
    sent = [m.request_id for m in held.received if isinstance(m, GenerateRequest)]
    assert len(sent) == 1 and wait_for(lambda: held.aborts == sent)

    failing = make_router(workers=[FakeWorker("d1", "colocated", mode="error_first")])
    empty = make_router(workers=[])

    async def failures() -> None:
        async with aiohttp.ClientSession() as s:
            status, retry_after, body = await complete(s, failing.base_url, [5], 2)
            assert status == 500 and retry_after is None and "boom" in body["error"]["message"]
            status, retry_after, body = await complete(s, empty.base_url, [5], 2)
            assert status == 503 and body["error"]["code"] == "no_workers"
            assert retry_after == str(UNAVAILABLE_RETRY_AFTER_S)
            text = await metrics_text(s, empty.base_url)
            assert metric(text, "tandem_requests_rejected_total", 'reason="no_workers"') == 1
            assert metric(text, "tandem_router_queued_requests") == 0

    asyncio.run(failures())
    for router in (failing, empty):
        assert router.server.admission.queued_requests == 0
        assert router.server.admission.queued_prompt_tokens == 0
