"""Frame fuzzing of the live server's side channels: each worker's ZMQ request socket (PULL;
fuzzed as a PUSH peer) and each KV agent's side channel (ROUTER; fuzzed as a DEALER peer), with
the frames of tests/fuzz/frames.py.

Invariants: every bad frame is counted (the workers' tandem_worker_bad_frames_total, exactly
as many as the real decoder refuses) or, on a side channel, answered with one ErrorReply (a
Hello with a HelloReply); a request streaming through the workers meanwhile finishes intact;
afterwards a disaggregated request is still served from transferred KV (no recompute, no
transfer failure), no worker died, and every KV block is free again.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
import urllib.parse
from collections import Counter

import pytest
import zmq
from e2e.e2e_helpers import TransferCheck
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.protocol import decode

from .conftest import LIVE_SETTINGS as FRAME_SETTINGS
from .conftest import SERVE_FLAGS, SERVED
from .frames import (
    KNOWN_BAD,
    MESSAGES,
    bad_frame_counts,
    side_channel_answer,
    worker_counts,
    worker_messages,
)
from .live import Request, json_request, send, still_serving


def _log_errors(server) -> str:
    """The serve log's tracebacks (worker exceptions reach it through Ray), for messages."""
    text = server.log_path.read_text()
    starts = [m.start() for m in re.finditer(r"Exception in thread|step failed", text)]
    return "\n".join(text[i : i + 2500] for i in starts[-2:]) or "(no traceback in the log)"


def _bad_frames(server) -> dict[str, float]:
    return bad_frame_counts(server.metrics())


class _Streaming(threading.Thread):
    """A long remote completion streaming while the fuzz runs: it must finish whole."""

    def __init__(self, url: str, tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.tokens = url, tokens
        self.started = threading.Event()
        self.events: list[bytes] = []
        self.status = 0

    def run(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
        body = {
            "model": SERVED,
            "prompt": list(range(200, 224)),
            "max_tokens": self.tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        self.status = resp.status
        for line in resp:
            if line.startswith(b"data: "):
                self.events.append(line.strip())
                self.started.set()
        self.started.set()
        conn.close()

    def check(self) -> None:
        self.join(timeout=300)
        assert self.status == 200 and self.events, (self.status, self.events[-2:])
        assert self.events[-1] == b"data: [DONE]", self.events[-3:]
        assert not any(e.startswith(b'data: {"error"') for e in self.events), self.events[-3:]
        usage = json.loads(self.events[-2].removeprefix(b"data: "))["usage"]
        assert usage["completion_tokens"] == self.tokens, usage


# Decode steps slowed to 10 ms (the testing-only fault seam): the long stream below then lasts
# about 9 s on any machine, so the fuzzed frames surely meet it (at full speed the tiny model
# decodes 900 tokens in under a second, and a slow box could finish before the first frame).
SLOW_DECODE = ("--inject-faults", json.dumps({"decode": {"step_delay_s": 0.01}}))


@pytest.fixture(scope="module")
def server(fuzz_model, start_serve):  # noqa: F811 - overrides the conftest's server
    with start_serve(fuzz_model, *SERVE_FLAGS, *SLOW_DECODE) as sp:
        yield sp


@pytest.fixture
def zmq_context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _workers_alive(server, names) -> None:
    health = json.loads(send(server.url, Request("GET", "/health")).body)
    assert sum(health["workers"].values()) == len(names), health


def test_worker_request_sockets(server, zmq_context):
    endpoints = server.endpoints()
    assert set(endpoints) == {"prefill-0", "decode-0"}
    before = _bad_frames(server)
    streaming = _Streaming(server.url, tokens=900)
    streaming.start()
    assert streaming.started.wait(120)
    assert streaming.status == 200 and streaming.is_alive(), (streaming.status, streaming.events)
    pushes = {}
    for name, (request_ep, _) in endpoints.items():
        pushes[name] = zmq_context.socket(zmq.PUSH)
        pushes[name].setsockopt(zmq.LINGER, 5000)
        pushes[name].connect(request_ep)
    expected: Counter[str] = Counter()

    @settings(FRAME_SETTINGS, max_examples=100)
    @given(worker=st.sampled_from(sorted(endpoints)), parts=worker_messages())
    def run(worker, parts):
        expected["while streaming"] += streaming.is_alive()
        pushes[worker].send_multipart(parts)
        expected[worker] += sum(bool(worker_counts(p)) for p in parts)

    for worker in endpoints:
        for parts in KNOWN_BAD.values():
            run = example(worker=worker, parts=parts)(run)
    run()
    assert expected["while streaming"] > 0  # the first frames at least met the stream
    want = {w: before.get(w, 0) + expected[w] for w in endpoints}
    deadline = time.monotonic() + 30
    while _bad_frames(server) != want and time.monotonic() < deadline:
        time.sleep(0.3)
    counted = _bad_frames(server)
    assert counted == want, f"counted {counted}, refused {want}\n{_log_errors(server)}"
    streaming.check()
    _workers_alive(server, endpoints)
    assert still_serving(server.url, SERVED) == []
    server.wait_all_blocks_free(timeout=30)


def test_kv_side_channels(server, zmq_context, fuzz_model):
    endpoints = server.endpoints()
    transfers = TransferCheck(server, fuzz_model)
    dealers = {}
    for name, (_, kv_ep) in endpoints.items():
        dealers[name] = zmq_context.socket(zmq.DEALER)
        dealers[name].setsockopt(zmq.LINGER, 0)
        dealers[name].connect(kv_ep)
    answers: Counter[str] = Counter()
    silent: dict[str, str] = {}  # worker -> the message its side channel did not answer

    @settings(FRAME_SETTINGS, max_examples=100)
    @given(worker=st.sampled_from(sorted(endpoints)), parts=MESSAGES)
    def run(worker, parts):
        dealer = dealers[worker]
        if worker in silent:  # no 5 s wait per message once a channel went quiet
            raise AssertionError(f"{worker}'s side channel went quiet at {silent[worker]}")
        dealer.send_multipart(parts)
        if not dealer.poll(5_000):
            silent[worker] = f"{parts!r:.300}"
            raise AssertionError(
                f"{worker}'s side channel stopped answering at {silent[worker]}\n"
                + _log_errors(server)
            )
        reply = dealer.recv_multipart()
        assert len(reply) == 1, reply
        answer = decode(reply[0])
        assert type(answer) is side_channel_answer(parts), (answer, f"{parts!r:.300}")
        answers[type(answer).__name__] += 1

    for worker in endpoints:
        for parts in KNOWN_BAD.values():
            run = example(worker=worker, parts=parts)(run)
    run()
    assert answers["ErrorReply"] > 0
    # The hand-off still works through both agents: a remote prompt is served from its KV
    # (token ids no other fuzz test sends, so no prefix cache shortens the transfer).
    prompt = list(range(100, 140))
    ans = send(server.url, json_request("/v1/completions", {"prompt": prompt, "max_tokens": 4}))
    assert ans.status == 200, ans.body[:300]
    transfers.verify([len(prompt)])
    _workers_alive(server, endpoints)
    assert still_serving(server.url, SERVED) == []
    server.wait_all_blocks_free(timeout=30)
