"""Decode-ahead in the serving loop: a real EngineServer (colocated) on its own thread, driven
over ZMQ with msgpack frames as the router drives it. Tokens stream one step late; every
request must still get exactly the tokens of an engine without decode-ahead, in order, with
one finish each; an abort mid-stream must end that request and free its blocks."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from engine import LLM
from engine.engine_server import EngineServer
from engine.llm_engine import EngineConfig, LLMEngine
from engine.protocol import AbortRequest, GenerateRequest, SamplingParams, TokenMessage, encode
from engine.protocol import decode as decode_frame

MAX_TOKENS = [14, 6, 25, 9, 3]


def _prompts():
    g = torch.Generator().manual_seed(21)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (4, 19, 7, 26, 12)]


class Live:
    def __init__(self, model) -> None:
        config = EngineConfig(model=str(model), dtype="float32", decode_ahead="on")
        self.server = EngineServer("w-ahead", "colocated", LLMEngine(config))
        self.server.start()
        self.ctx = zmq.Context()
        self.sink = self.ctx.socket(zmq.PULL)
        self.sink.bind("tcp://127.0.0.1:*")
        self.reply_to = self.sink.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(self.server.endpoint)
        self.messages: dict[str, list[TokenMessage]] = {}

    def send(self, frame) -> None:
        self.push.send(encode(frame))

    def collect(self, rids: set[str], timeout: float = 60.0) -> dict[str, list[TokenMessage]]:
        """Frames until each of `rids` has its finish; every frame received is kept, by
        request, in `self.messages` (other requests' too)."""
        deadline = time.time() + timeout
        while not all(self._finished(rid) for rid in rids):
            assert self.sink.poll(int(max(1, deadline - time.time()) * 1000)), "no tokens"
            m = decode_frame(self.sink.recv(), expect=TokenMessage)
            self.messages.setdefault(m.request_id, []).append(m)
        return {rid: self.messages[rid] for rid in rids}

    def _finished(self, rid: str) -> bool:
        msgs = self.messages.get(rid, [])
        return bool(msgs) and msgs[-1].finish_reason is not None

    def drain_frames(self) -> None:
        while self.sink.poll(200):
            m = decode_frame(self.sink.recv(), expect=TokenMessage)
            self.messages.setdefault(m.request_id, []).append(m)

    def wait_idle(self, timeout: float = 10.0) -> None:
        engine, deadline = self.server.engine, time.time() + timeout
        bm = engine.block_manager
        while engine.seqs or bm.num_free_blocks != bm.num_blocks:
            assert time.time() < deadline, "a request or its blocks outlived it"
            time.sleep(0.01)

    def close(self) -> None:
        self.push.close(linger=0)
        self.sink.close(linger=0)
        self.ctx.term()
        self.server.stop()


@pytest.fixture(scope="module")
def live(make_tiny_model):
    rig = Live(make_tiny_model("llama"))
    yield rig
    rig.close()


@pytest.fixture(scope="module")
def reference(make_tiny_model):
    llm = LLM(make_tiny_model("llama"), dtype="float32", decode_ahead="off")
    sps = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in MAX_TOKENS]
    return [o.token_ids for o in llm.generate(_prompts(), sps)]


def _sampling(m: int) -> SamplingParams:
    return SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)


def test_streams_equal_an_engine_without_decode_ahead(live, reference):
    rids = [f"s{i}" for i in range(len(MAX_TOKENS))]
    for rid, p, m in zip(rids, _prompts(), MAX_TOKENS, strict=True):
        live.send(GenerateRequest(rid, p, _sampling(m), live.reply_to))
    got = live.collect(set(rids))
    for rid, want in zip(rids, reference, strict=True):
        msgs = got[rid]
        assert [t for m in msgs for t in m.token_ids] == want, rid
        assert [m.finish_reason for m in msgs].count("length") == 1
        assert msgs[-1].finish_reason == "length"
    assert live.server.engine.ahead.launched > 0  # the serving loop took the path
    live.wait_idle()


def test_an_abort_mid_stream_ends_that_request_only(live, reference):
    live.send(GenerateRequest("long", _prompts()[2], _sampling(400), live.reply_to))
    live.send(GenerateRequest("short", _prompts()[0], _sampling(14), live.reply_to))
    got = live.collect({"short"})
    live.send(AbortRequest("long"))
    live.wait_idle()  # the engine dropped it and freed its blocks
    live.drain_frames()
    assert [t for m in got["short"] for t in m.token_ids] == reference[0]
    tokens = [t for m in live.messages["long"] for t in m.token_ids]
    assert 0 < len(tokens) < 400  # streamed until the abort, never finished
    assert all(m.finish_reason is None for m in live.messages["long"])
    n = min(len(tokens), len(reference[2]))
    assert tokens[:n] == reference[2][:n]  # greedy: the 25-token reference is its prefix
