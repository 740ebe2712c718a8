"""The prefill and decode KV connectors as objects of their own, composed with the one serving
loop (`EngineServer`) around a scripted engine and a scripted agent: every way a request can
end leaves no per-request state behind (one record per request, in `connector.requests`), the
blocks go back to the engine exactly when no READ can land any more, and the counters the load
report carries move as before. No model, no NIXL: tests/workers drives the real ones."""

from __future__ import annotations

import time

import pytest

from engine.engine_server import EngineServer, NoConnector
from engine.kv_connector import Handoff
from engine.outputs import TokenOutput
from engine.protocol import (
    AbortRequest,
    GenerateRequest,
    PrefillRequest,
    SamplingParams,
    TokenMessage,
)
from engine.roles import COLOCATED, DECODE, PREFILL
from kv_transfer import decode_connector
from kv_transfer.decode_connector import DecodeConnector, DecodeStage
from kv_transfer.errors import HandshakeError, StalePeerError, TransferError
from kv_transfer.messages import (
    AgentMetadata,
    KVReady,
    ReadDone,
    ReadFailed,
    Released,
    TransferStats,
)
from kv_transfer.prefill_connector import PrefillConnector, PrefillStage

SP = SamplingParams(max_tokens=4)
PROMPT = list(range(5, 25))  # 20 tokens: two blocks of 16
ROUTER = "tcp://127.0.0.1:5999"


def _md(name="p0", instance="i0") -> AgentMetadata:
    return AgentMetadata(
        name=name,
        instance_id=instance,
        endpoint="tcp://127.0.0.1:6001",
        protocol_version=1,
        compat_hash="h",
        compat_fields={"block_size": "16"},
        num_blocks=64,
        mem_type="DRAM",
    )


class FakeEngine:
    """The engine calls a connector and a loop make, with the request's state as a string."""

    def __init__(self):
        self.seqs: dict[str, str] = {}
        self.released: list[str] = []
        self.kv_connector = None
        self.num_steps = 0

    def set_kv_connector(self, connector) -> None:
        self.kv_connector = connector

    def add_request(self, rid, prompt, sampling) -> None:
        if rid in self.seqs or not prompt:
            raise ValueError(f"request id {rid!r} is already in use")
        self.seqs[rid] = "waiting"

    def add_remote_request(self, rid, prompt, first_token, sampling, choices=None) -> None:
        if rid in self.seqs:
            raise ValueError(f"request id {rid!r} is already in use")
        self.seqs[rid] = "waiting_remote"

    def release(self, rid) -> None:
        assert self.seqs.pop(rid) == "prefilled", "released a request that was not handed off"
        self.released.append(rid)

    def abort(self, rid) -> bool:
        return self.seqs.pop(rid, None) is not None

    def commit_remote(self, rid) -> list:
        assert self.seqs[rid] == "remote_kv"
        self.seqs[rid] = "running"
        return []

    def recompute_remote(self, rid) -> None:
        assert self.seqs[rid] == "remote_kv"
        self.seqs[rid] = "recompute"

    def pop_finished(self, rid):
        return self.seqs.pop(rid, None)

    def has_unfinished(self) -> bool:
        return False

    def stats(self) -> dict:
        keys = ("num_free_blocks", "num_total_blocks", "num_running", "num_waiting")
        more = ("queued_prefill_tokens", "num_preemptions", "prefix_hit_tokens")
        return dict.fromkeys((*keys, *more, "prefix_query_tokens"), 0)

    # What LLMEngine.step does around its connector calls.
    def prefill_done(self, rid, blocks=(3, 4)) -> bool:
        self.seqs[rid] = "prefilled"
        ok = self.kv_connector.on_prefilled(Handoff(rid, list(blocks), 7, len(PROMPT)))
        if not ok:
            self.release(rid)
        return ok

    def admit(self, rid, blocks=(10, 11)) -> None:
        self.seqs[rid] = "remote_kv"
        self.kv_connector.on_remote_admitted(rid, list(blocks), 0)


class FakeAgent:
    def __init__(self):
        self.events: list = []
        self.held: dict[str, list[int]] = {}
        self.aborted: list[tuple[str, str | None]] = []
        self.reads: dict[str, tuple] = {}
        self.hold_error: Exception | None = None
        self.connect_error: Exception | None = None
        self.read_error: Exception | None = None
        self.closed = False

    def hold(self, rid, block_ids, peer_name) -> float:
        if self.hold_error is not None:
            raise self.hold_error
        self.held[rid] = block_ids
        return time.time() + 30

    def abort(self, rid, peer_name=None) -> bool:
        self.aborted.append((rid, peer_name))
        return True

    def connect(self, md) -> None:
        if self.connect_error is not None:
            raise self.connect_error

    def start_read(self, rid, peer, remote, local, deadline, sender_instance=None) -> None:
        if self.read_error is not None:
            raise self.read_error
        self.reads[rid] = (peer, remote, local, sender_instance)

    def poll(self) -> list:
        out, self.events = self.events, []
        return out

    def release(self, rid, reason) -> None:
        self.events.append(Released(rid, tuple(self.held.pop(rid)), reason))

    def num_held(self) -> int:
        return len(self.held)

    def stats(self) -> TransferStats:
        return TransferStats()

    def agent_metadata(self) -> AgentMetadata:
        return _md()

    def close(self) -> None:
        self.closed = True


class FakeReplies:
    def __init__(self):
        self.sent: list[tuple[str, object]] = []

    def send(self, endpoint, msg) -> None:
        self.sent.append((endpoint, msg))

    def take_disconnected(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


def _server(role, connector):
    engine = FakeEngine()
    server = EngineServer("w0", role, engine, connector)
    server.replies = FakeReplies()
    return server, engine


@pytest.fixture
def prefill():
    agent = FakeAgent()
    server, engine = _server(PREFILL, PrefillConnector(agent))
    yield server, engine, agent
    server.close()


@pytest.fixture
def decode():
    agent = FakeAgent()
    server, engine = _server(DECODE, DecodeConnector(agent))
    yield server, engine, agent
    server.close()


def _empty(server) -> bool:
    """No per-request state anywhere in the worker: loop, connector and engine."""
    conn = server.connector
    return not (server.reply_to or server.open_choices or conn.requests or server.engine.seqs)


def _prefill_request(server, rid="r"):
    server.handle(PrefillRequest(rid, PROMPT, SP, ROUTER, "d0", "tcp://127.0.0.1:7001"))


def _errors(server) -> list[TokenMessage]:
    return [m for _, m in server.replies.sent if getattr(m, "finish_reason", None) == "error"]


# -- composition -------------------------------------------------------------------------------


def test_a_server_refuses_a_connector_of_another_role():
    with pytest.raises(ValueError, match="prefill connector cannot serve a decode worker"):
        EngineServer("w", DECODE, FakeEngine(), PrefillConnector(FakeAgent()))


def test_a_colocated_server_has_no_connector_and_closes_its_agent_otherwise():
    server, engine = _server(COLOCATED, None)
    assert isinstance(server.connector, NoConnector) and engine.kv_connector is None
    server.close()
    agent = FakeAgent()
    server, engine = _server(PREFILL, PrefillConnector(agent))
    assert engine.kv_connector is server.connector
    server.close()
    assert agent.closed


# -- prefill side ------------------------------------------------------------------------------


def test_prefill_handoff_ends_on_read_done(prefill):
    server, engine, agent = prefill
    _prefill_request(server)
    assert server.connector.requests["r"].stage is PrefillStage.QUEUED
    assert server.connector.has_pending_work() and not server.is_idle()
    assert engine.prefill_done("r")
    assert server.connector.requests["r"].stage is PrefillStage.HELD
    assert not server.replies.sent  # the KVReady waits for the step's tokens
    server.connector.after_step()
    ((endpoint, ready),) = server.replies.sent
    assert endpoint == "tcp://127.0.0.1:7001" and isinstance(ready, KVReady)
    assert ready.block_ids == [3, 4] and ready.first_token == 7 and ready.sender == _md()
    assert not server.reply_to  # the decode worker streams the rest
    agent.release("r", "read_done")
    server.connector.before_step()
    assert engine.released == ["r"] and _empty(server) and server.is_idle()
    load = server.load().extra
    assert load["handoffs"] == 1 and load["released"] == {"read_done": 1}


@pytest.mark.parametrize("reason", ["lease_expired", "aborted", "peer_failed", "peer_restarted"])
def test_prefill_lease_ending_otherwise_frees_the_blocks(prefill, reason):
    server, engine, agent = prefill
    _prefill_request(server)
    engine.prefill_done("r")
    server.connector.after_step()
    agent.release("r", reason)
    server.connector.before_step()
    assert engine.released == ["r"] and _empty(server)
    assert server.connector.released_reasons == {reason: 1}


def test_prefill_request_finished_by_its_first_token_leaves_nothing(prefill):
    server, engine, _ = prefill
    _prefill_request(server)
    server.publish([TokenOutput("r", 0, [7], "length")])  # max_tokens=1: never handed off
    ((_, first),) = server.replies.sent
    assert first.token_ids == [7] and first.finish_reason == "length"
    assert _empty(server)


def test_prefill_abort_while_queued_drops_it_from_the_engine(prefill):
    server, engine, agent = prefill
    _prefill_request(server)
    server.handle(AbortRequest("r"))
    assert _empty(server) and server.num_aborts == 1 and not agent.aborted


def test_prefill_abort_while_held_frees_only_on_released(prefill):
    server, engine, agent = prefill
    _prefill_request(server)
    engine.prefill_done("r")
    server.connector.after_step()
    server.handle(AbortRequest("r"))
    assert agent.aborted == [("r", None)] and server.num_aborts == 1
    assert engine.seqs == {"r": "prefilled"}  # a READ may still land: the blocks stay
    assert not server.connector.holds_nothing()
    agent.release("r", "aborted")
    server.connector.before_step()
    assert engine.released == ["r"] and _empty(server)


def test_prefill_abort_before_the_handoff_went_out_never_offers_it(prefill):
    # A failed step: fail_all aborts a request handed over during that step.
    server, engine, agent = prefill
    _prefill_request(server)
    engine.prefill_done("r")
    server.fail_all("internal error in the engine step")
    server.connector.after_step()
    assert not [m for _, m in server.replies.sent if isinstance(m, KVReady)]
    agent.release("r", "aborted")
    server.connector.before_step()
    assert _empty(server)


def test_prefill_lease_refused_fails_the_request_after_the_step(prefill):
    server, engine, agent = prefill
    agent.hold_error = TransferError("r", "its blocks are already held")
    _prefill_request(server)
    assert not engine.prefill_done("r")  # refused: the engine freed the blocks
    assert not _errors(server)  # the first token goes out first
    server.connector.after_step()
    (err,) = _errors(server)
    assert err.request_id == "r" and "KV hand-off failed" in err.error
    assert _empty(server)


def test_prefill_invalid_request_keeps_no_record(prefill):
    server, engine, _ = prefill
    engine.seqs["r"] = "waiting"  # the id is in use
    _prefill_request(server)
    assert len(_errors(server)) == 1 and not server.connector.requests and not server.reply_to


# -- decode side -------------------------------------------------------------------------------


def _ready(rid="r", deadline=None) -> KVReady:
    return KVReady(
        request_id=rid,
        prompt_token_ids=PROMPT,
        sampling=SP,
        first_token=7,
        reply_to=ROUTER,
        prefill_worker_id="p0",
        sender=_md(),
        block_ids=[3, 4],
        num_tokens=len(PROMPT),
        lease_deadline=time.time() + 30 if deadline is None else deadline,
    )


def _stage(server, rid="r"):
    rec = server.connector.requests.get(rid)
    return None if rec is None else rec.stage


def test_decode_remote_prefill_ends_on_read_done(decode):
    server, engine, agent = decode
    server.handle(_ready())
    assert _stage(server) is DecodeStage.QUEUED and server.reply_to == {"r": ROUTER}
    ((endpoint, handoff),) = server.replies.sent
    assert endpoint == ROUTER and handoff.handoff and handoff.worker_id == "w0"
    assert server.load().extra["incoming"] == 1
    engine.admit("r")
    assert _stage(server) is DecodeStage.READING and server.connector.has_pending_work()
    assert agent.reads["r"] == ("p0", [3, 4], [10, 11], "i0")
    assert server.load().extra["reading"] == 1
    agent.events.append(ReadDone("r", (10, 11), 1024, 0.01))
    server.connector.before_step()
    assert engine.seqs == {"r": "running"} and not server.connector.requests
    assert server.connector.holds_nothing() and server.load().extra["remote_prefills"] == 1


def test_decode_failed_read_recomputes_by_default(decode):
    server, engine, agent = decode
    server.handle(_ready())
    engine.admit("r")
    agent.events.append(ReadFailed("r", (10, 11), "peer died"))
    server.connector.before_step()
    assert engine.seqs == {"r": "recompute"} and not server.connector.requests
    assert server.connector.num_recomputed == 1 and not _errors(server)


def test_decode_failed_read_fails_the_request_under_the_error_policy():
    agent = FakeAgent()
    server, engine = _server(DECODE, DecodeConnector(agent, on_transfer_failure="error"))
    try:
        server.handle(_ready())
        engine.admit("r")
        agent.events.append(ReadFailed("r", (10, 11), "peer died"))
        server.connector.before_step()
        (err,) = _errors(server)
        assert "KV transfer from p0 failed: peer died" in err.error
        assert _empty(server)
    finally:
        server.close()


def test_decode_policy_is_checked():
    with pytest.raises(ValueError, match="on_transfer_failure"):
        DecodeConnector(FakeAgent(), on_transfer_failure="retry")
    assert decode_connector.FAILURE_POLICIES == ("recompute", "error")


def test_decode_lease_lapsed_in_the_queue_recomputes_without_reading(decode):
    server, engine, agent = decode
    server.handle(_ready(deadline=time.time() - 1))
    engine.admit("r")
    assert engine.seqs == {"r": "recompute"} and not agent.reads
    assert not server.connector.requests


def test_decode_incompatible_peer_fails_even_under_recompute(decode):
    server, engine, agent = decode
    server.handle(_ready())
    agent.connect_error = HandshakeError("p0", "block_size differs", ("block_size",))
    engine.admit("r")
    (err,) = _errors(server)
    assert err.request_id == "r" and "block_size" in err.error
    assert _empty(server) and not agent.reads


def test_decode_stale_sender_or_refused_read_recomputes(decode):
    server, engine, agent = decode
    server.handle(_ready("a"))
    server.handle(_ready("b"))
    agent.connect_error = StalePeerError("p0", "i0", "an old incarnation")
    engine.admit("a")
    agent.connect_error, agent.read_error = None, TransferError("b", "not connected")
    engine.admit("b")
    assert engine.seqs == {"a": "recompute", "b": "recompute"} and not server.connector.requests
    assert ("b", "p0") in agent.aborted  # no READ will come: the sender is told at once


def test_decode_abort_before_kvready_drops_the_late_kvready(decode):
    server, engine, agent = decode
    server.handle(AbortRequest("r"))
    assert _stage(server) is DecodeStage.ABORTED_EARLY and server.num_aborts == 0
    assert server.connector.holds_nothing() and server.is_idle()
    server.handle(_ready())
    assert agent.aborted == [("r", "p0")] and server.num_aborts == 1
    assert _empty(server) and not server.replies.sent


def test_decode_early_aborts_are_bounded_oldest_first(decode, monkeypatch):
    server, _, _ = decode
    monkeypatch.setattr(decode_connector, "MAX_EARLY_ABORTS", 3)
    server.handle(_ready("kept"))
    for i in range(5):
        server.handle(AbortRequest(f"x{i}"))
    early = [
        r for r, x in server.connector.requests.items() if x.stage is DecodeStage.ABORTED_EARLY
    ]
    assert early == ["x2", "x3", "x4"] and _stage(server, "kept") is DecodeStage.QUEUED


def test_decode_abort_while_queued_releases_the_sender(decode):
    server, engine, agent = decode
    server.handle(_ready())
    server.handle(AbortRequest("r"))
    assert agent.aborted == [("r", "p0")] and server.num_aborts == 1 and _empty(server)


@pytest.mark.parametrize("event", ["failed", "done"])
def test_decode_abort_during_the_read_frees_the_blocks_when_it_is_over(decode, event):
    server, engine, agent = decode
    server.handle(_ready())
    engine.admit("r")
    server.handle(AbortRequest("r"))
    assert _stage(server) is DecodeStage.CANCELLING and server.num_aborts == 1
    assert engine.seqs == {"r": "remote_kv"}  # a READ may still land in its blocks
    assert not server.reply_to and not server.connector.holds_nothing()
    late = ReadFailed("r", (10, 11), "aborted") if event == "failed" else ReadDone("r", (), 0, 0)
    agent.events.append(late)
    server.connector.before_step()
    assert _empty(server) and server.connector.num_remote == 0


def test_decode_duplicate_kvready_is_refused_and_released(decode):
    server, engine, agent = decode
    server.handle(_ready())
    server.handle(_ready())
    (err,) = _errors(server)
    assert "already in use" in err.error and agent.aborted == [("r", "p0")]
    assert _stage(server) is DecodeStage.QUEUED


def test_decode_counts_local_prefills_and_leaves_them_to_the_loop(decode):
    server, engine, _ = decode
    server.handle(GenerateRequest("g", PROMPT, SP, ROUTER))
    assert engine.seqs == {"g": "waiting"} and not server.connector.requests
    assert server.load().extra["local_prefills"] == 1
    server.handle(AbortRequest("g"))
    assert _empty(server) and server.num_aborts == 1
