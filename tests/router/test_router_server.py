"""The router end to end over real HTTP and real ZMQ, against fake workers (router_fakes)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
import zmq
from router_fakes import FakeWorker, echo_tokens

from engine.protocol import WIRE_VERSION, GenerateRequest, PrefillRequest

PROMPT = "The quick brown fox jumps over the lazy dog."


def wait_for(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def expected_text(tok, prompt_ids: list[int], n: int) -> str:
    return tok.decode(echo_tokens(prompt_ids, n), skip_special_tokens=True)


def metric_value(text: str, name: str, labels: str = "") -> float:
    needle = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(needle + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{needle} not in metrics")


async def _get(url: str, **kw) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(url, **kw) as r:
        return r.status, await r.text()


async def _post(url: str, data: bytes | str, headers: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=headers) as r:
        return r.status, await r.json(content_type=None)


# ---------------------------------------------------------------------------- happy paths


def test_completion_stream_and_nonstream_agree(make_router, model_info):
    h = make_router()
    client = h.openai()
    tok = model_info.tokenizer
    ids = tok(PROMPT)["input_ids"]
    res = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=20, temperature=0)
    assert res.choices[0].text == expected_text(tok, ids, 20)
    assert res.choices[0].finish_reason == "length"
    assert res.usage.prompt_tokens == len(ids)
    assert res.usage.completion_tokens == 20
    assert res.usage.total_tokens == len(ids) + 20

    chunks = list(
        client.completions.create(
            model="tiny-llama",
            prompt=PROMPT,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == res.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].choices == []
    # A GenerateRequest (local prefill) reached the colocated worker with our sampling.
    reqs = [m for m in h.workers[0].received if isinstance(m, GenerateRequest)]
    assert reqs and reqs[0].sampling.temperature == 0 and reqs[0].prompt_token_ids == ids
    assert reqs[0].reply_to == h.server.reply_endpoint


def test_token_ids_prompt(make_router, model_info):
    h = make_router()
    res = h.openai().completions.create(model="tiny-llama", prompt=[5, 6, 7, 8], max_tokens=6)
    assert res.choices[0].text == expected_text(model_info.tokenizer, [5, 6, 7, 8], 6)
    assert res.usage.prompt_tokens == 4


def test_chat_stream_and_nonstream_agree(make_router, model_info):
    h = make_router(workers=[FakeWorker("d0", "colocated", chunk=3)])
    client = h.openai()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    res = client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=25)
    tok = model_info.tokenizer
    ids = tok(
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == expected_text(tok, ids, 25)
    assert res.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(
        model="tiny-llama", messages=msgs, max_completion_tokens=25, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == res.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_truncates_and_aborts(make_router, model_info):
    h = make_router()
    client = h.openai()
    # Echo repeats the prompt: "The quick brown fox jumps over ..." -> cut before " fox".
    res = client.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=40, stop=[" fox", "zzz"]
    )
    assert res.choices[0].text == "The quick brown"
    assert res.choices[0].finish_reason == "stop"
    assert wait_for(lambda: h.workers[0].aborts)
    chunks = list(
        client.completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=40, stop=" fox", stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == "The quick brown"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_disaggregated_path_splits_first_token(make_router, model_info):
    dec = FakeWorker("d0", "decode", chunk=2)
    pre = FakeWorker("p0", "prefill", partner=dec)
    h = make_router(workers=[pre, dec], disagg_threshold=8)
    client = h.openai()
    tok = model_info.tokenizer
    ids = tok(PROMPT)["input_ids"]
    assert len(ids) >= 8
    res = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=12)
    assert res.choices[0].text == expected_text(tok, ids, 12)
    pre_reqs = [m for m in pre.received if isinstance(m, PrefillRequest)]
    assert len(pre_reqs) == 1
    assert pre_reqs[0].decode_worker_id == "d0" and pre_reqs[0].decode_endpoint == dec.endpoint
    assert dec.handoffs and not [m for m in dec.received if isinstance(m, GenerateRequest)]
    # A short prompt stays local (prefill on the decode worker).
    short = client.completions.create(model="tiny-llama", prompt=[9, 10], max_tokens=3)
    assert short.choices[0].text == expected_text(tok, [9, 10], 3)
    assert [m for m in dec.received if isinstance(m, GenerateRequest)]
    _, metrics = asyncio.run(_get(h.base_url + "/metrics"))
    assert metric_value(metrics, "tandem_disagg_decisions_total", 'path="remote"') == 1
    assert metric_value(metrics, "tandem_disagg_decisions_total", 'path="local"') == 1


def test_out_of_order_and_duplicate_tokens(make_router, model_info):
    h = make_router(workers=[FakeWorker("d0", "colocated", mode="shuffle")])
    tok = model_info.tokenizer
    ids = tok(PROMPT)["input_ids"]
    res = h.openai().completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=10)
    assert res.choices[0].text == expected_text(tok, ids, 10)
    assert res.usage.completion_tokens == 10


# ---------------------------------------------------------------------------- failures


def test_worker_error_before_and_during_stream(make_router):
    h = make_router(workers=[FakeWorker("d0", "colocated", mode="error_first")])
    status, body = asyncio.run(
        _post(h.base_url + "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 5}))
    )
    assert status == 500 and "boom" in body["error"]["message"]

    h2 = make_router(workers=[FakeWorker("d1", "colocated", mode="error", delay_s=0.05)])

    async def stream() -> tuple[int, list[str]]:
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                h2.base_url + "/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 5, "stream": True},
            ) as r,
        ):
            raw = (await r.read()).decode()
            return r.status, [e[len("data: ") :] for e in raw.split("\n\n") if e]

    status, events = asyncio.run(stream())
    assert status == 200
    assert events[-1] == "[DONE]"
    assert "boom" in json.loads(events[-2])["error"]["message"]
    assert asyncio.run(_get(h2.base_url + "/health"))[0] == 200


def test_gap_timeout_is_an_error(make_router):
    # "silent" never answers: the request times out with a 5xx, the router stays healthy.
    h = make_router(workers=[FakeWorker("d0", "colocated", mode="silent")], request_timeout_s=0.5)
    status, body = asyncio.run(
        _post(h.base_url + "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}))
    )
    assert status == 504 and body["error"]["code"] == "timeout"
    assert wait_for(lambda: h.workers[0].aborts)


def test_index_gap_outliving_deadline_is_an_error(make_router):
    h = make_router(workers=[FakeWorker("d0", "colocated", mode="gap")], token_gap_timeout_s=0.3)
    t0 = time.monotonic()
    status, body = asyncio.run(
        _post(h.base_url + "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 4}))
    )
    assert status == 500 and body["error"]["code"] == "token_gap"
    assert "gap" in body["error"]["message"]
    assert time.monotonic() - t0 < 5
    assert wait_for(lambda: h.workers[0].aborts)


def test_worker_leaving_the_pool_fails_its_requests(make_router):
    h = make_router(workers=[FakeWorker("d0", "colocated", mode="silent")], refresh_interval_s=0.1)

    async def go():
        task = asyncio.ensure_future(
            _post(h.base_url + "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 4}))
        )
        await asyncio.sleep(0.3)
        assert not task.done()
        h.directory.set_workers([])
        return await asyncio.wait_for(task, 5)

    status, body = asyncio.run(go())
    assert status == 503 and "left the pool" in body["error"]["message"]


def test_worker_overrun_is_cut_at_max_tokens(make_router, model_info):
    h = make_router(workers=[FakeWorker("d0", "colocated", mode="overrun", chunk=3)])
    res = h.openai().completions.create(model="tiny-llama", prompt=[5, 6, 7], max_tokens=7)
    assert res.usage.completion_tokens == 7 and res.choices[0].finish_reason == "length"
    assert res.choices[0].text == expected_text(model_info.tokenizer, [5, 6, 7], 7)
    assert wait_for(lambda: h.workers[0].aborts)  # the worker did not finish: told to stop


def test_no_workers_is_503(make_router):
    h = make_router(workers=[])
    status, body = asyncio.run(_post(h.base_url + "/v1/completions", json.dumps({"prompt": "hi"})))
    assert status == 503 and body["error"]["code"] == "no_workers"


def test_client_disconnect_aborts(make_router):
    dec = FakeWorker("d0", "decode", delay_s=0.05)
    pre = FakeWorker("p0", "prefill", partner=dec)
    h = make_router(workers=[pre, dec], disagg_threshold=4)

    async def go(stream: bool) -> None:
        async with aiohttp.ClientSession() as s:
            req = s.post(
                h.base_url + "/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 200, "stream": stream},
            )
            if stream:
                async with req as r:
                    await r.content.readline()  # first event arrives, then hang up
            else:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(req, timeout=0.5)

    for stream in (True, False):
        before_pre, before_dec = len(pre.aborts), len(dec.aborts)
        asyncio.run(go(stream))
        assert wait_for(
            lambda b=before_dec, p=before_pre: len(dec.aborts) > b and len(pre.aborts) > p
        )
    _, metrics = asyncio.run(_get(h.base_url + "/metrics"))
    assert metric_value(metrics, "tandem_requests_total", 'status="cancelled"') == 2


def test_client_disconnect_aborts_every_prompt_of_a_batch(make_router):
    """A completions batch runs one request per prompt, each read by its own task: a client
    that hangs up must abort all of them, streamed or not."""
    dec = FakeWorker("d0", "decode", delay_s=0.05)
    pre = FakeWorker("p0", "prefill", partner=dec)
    h = make_router(workers=[pre, dec], disagg_threshold=4)

    async def go(stream: bool) -> None:
        async with aiohttp.ClientSession() as s:
            body = {"prompt": [PROMPT, PROMPT + " again"], "max_tokens": 200, "stream": stream}
            req = s.post(h.base_url + "/v1/completions", json=body)
            if stream:
                async with req as r:
                    await r.content.readline()
            else:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(req, timeout=0.5)

    for stream in (True, False):
        before = len(dec.aborts)
        asyncio.run(go(stream))
        assert wait_for(lambda b=before: len(dec.aborts) >= b + 2), (stream, dec.aborts)


def test_malformed_frames_are_dropped(make_router, model_info):
    h = make_router()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(h.server.reply_endpoint)
    import msgpack

    push.send(b"\xc1 definitely not msgpack")
    push.send(msgpack.packb({"v": WIRE_VERSION, "t": "tokens", "d": {"request_id": 3}}))
    push.send(msgpack.packb({"v": WIRE_VERSION, "t": "nope", "d": {}}))
    push.send(b"\x00" * (h.server.config.max_frame_bytes + 1))
    push.send_multipart([b"a", b"b"])
    push.close()
    ctx.term()
    assert wait_for(lambda: h.server.dataplane.num_bad_frames == 5)
    res = h.openai().completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=4)
    assert res.choices[0].text == expected_text(
        model_info.tokenizer, model_info.tokenizer(PROMPT)["input_ids"], 4
    )
    _, metrics = asyncio.run(_get(h.base_url + "/metrics"))
    assert metric_value(metrics, "tandem_bad_frames_total") == 5


def test_token_sink_binds_loopback(make_router):
    h = make_router()
    assert h.server.dataplane.bound_endpoint.startswith("tcp://127.0.0.1:")
    assert h.server.reply_endpoint.startswith("tcp://127.0.0.1:")


# ---------------------------------------------------------------------------- auth, metrics


def test_api_key(make_router):
    import openai

    h = make_router(api_key="sekret")
    status, body = asyncio.run(_get(h.base_url + "/v1/models"))
    assert status == 401 and body and json.loads(body)["error"]["code"] == "invalid_api_key"
    status, _ = asyncio.run(
        _get(h.base_url + "/metrics", headers={"Authorization": "Bearer wrong"})
    )
    assert status == 401
    assert asyncio.run(_get(h.base_url + "/health"))[0] == 200
    with pytest.raises(openai.AuthenticationError):
        h.openai(api_key="wrong").completions.create(model="tiny-llama", prompt="hi")
    res = h.openai(api_key="sekret").completions.create(
        model="tiny-llama", prompt="hi", max_tokens=2
    )
    assert res.usage.completion_tokens == 2
    assert [m.id for m in h.openai(api_key="sekret").models.list()] == ["tiny-llama"]
    assert "sekret" not in repr(h.server.config)


def test_one_model_by_name_or_path_and_an_unknown_one_is_404(make_router):
    import openai

    h = make_router()
    client = h.openai()
    card = client.models.retrieve("tiny-llama")
    assert (card.id, card.object) == ("tiny-llama", "model")
    by_path = client.models.retrieve(str(h.server.config.model_path))  # a path holds slashes
    assert by_path.id == "tiny-llama"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("other-model")
    assert e.value.body["code"] == "model_not_found" and "other-model" in e.value.body["message"]


def test_metrics_names(make_router):
    h = make_router()
    h.openai().completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=5)
    status, text = asyncio.run(_get(h.base_url + "/metrics"))
    assert status == 200
    for name in (
        "tandem_ttft_seconds_bucket",
        "tandem_tpot_seconds_bucket",
        "tandem_itl_seconds_bucket",
        "tandem_e2e_seconds_bucket",
        "tandem_queue_depth",
        "tandem_running_requests",
        "tandem_kv_free_blocks",
        "tandem_kv_total_blocks",
        "tandem_kv_usage_ratio",
        "tandem_kv_transfer_bytes_total",
        "tandem_kv_transfer_seconds_total",
        "tandem_kv_transfer_failures_total",
        "tandem_kv_expired_leases_total",
        "tandem_disagg_decisions_total",
        "tandem_requests_total",
    ):
        assert name in text, name
    assert metric_value(text, "tandem_requests_total", 'status="success"') == 1
    assert metric_value(text, "tandem_ttft_seconds_count") == 1
    assert (
        metric_value(text, "tandem_kv_transfer_bytes_total", 'role="colocated",worker="d0"') == 1234
    )


def test_burst_spreads_over_decode_workers(make_router):
    workers = [FakeWorker("d0", "colocated", delay_s=0.01), FakeWorker("d1", "colocated")]
    h = make_router(workers=workers, refresh_interval_s=60)  # no refresh: optimistic view only

    async def burst():
        return await asyncio.gather(
            *[
                _post(h.base_url + "/v1/completions", json.dumps({"prompt": [5], "max_tokens": 3}))
                for _ in range(6)
            ]
        )

    results = asyncio.run(burst())
    assert all(status == 200 for status, _ in results)
    counts = [len([m for m in w.received if isinstance(m, GenerateRequest)]) for w in workers]
    assert counts == [3, 3]


def test_chat_stream_usage_chunk(make_router):
    h = make_router()
    stream = h.openai().chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"


def test_start_failure_releases_sockets(model_dir, model_info):
    import socket

    from router.config import RouterConfig
    from router.directory import StaticDirectory
    from router.server import RouterServer

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cfg = RouterConfig(model_path=model_dir, port=busy.getsockname()[1])
        server = RouterServer(cfg, StaticDirectory([]), model_info=model_info)
        with pytest.raises(OSError):
            asyncio.run(server.start())
    assert server.dataplane._pull is None and server.pool._refresh_task is None
