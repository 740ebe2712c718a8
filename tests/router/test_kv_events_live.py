"""KV events over real ZMQ: two colocated engine servers (real engines, tiny model) publish
their block events, the router's listener (router/kv_listener.py) mirrors them in its index.
After requests the index holds exactly each worker's cached hashes; batches dropped on the
wire are noticed (heartbeat gap) and resynced; a restarted worker (new incarnation) and a
worker leaving the directory are followed; kv-events routing picks the worker holding the
prompt's prefix. One pair of servers for the module."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from engine.engine_server import EngineServer
from engine.llm_engine import EngineConfig, LLMEngine
from engine.protocol import GenerateRequest, SamplingParams, TokenMessage, decode, encode
from router.directory import WorkerInfo
from router.kv_index import KVIndex
from router.kv_listener import KVEventListener
from router.routing import LoadView, plan_route_kv

BS = 4


def _server(model, wid: str) -> EngineServer:
    engine = LLMEngine(
        EngineConfig(model=str(model), dtype="float32", block_size=BS, num_kv_blocks=48)
    )
    server = EngineServer(wid, "colocated", engine)
    server.start()
    return server


def _info(s: EngineServer) -> WorkerInfo:
    events, snapshot = s.kv_events_endpoints
    return WorkerInfo(
        s.worker_id,
        s.role,
        s.endpoint,
        s.latest_load(),
        s.kv_events.incarnation,
        kv_events_endpoint=events,
        kv_snapshot_endpoint=snapshot,
    )


class Rig:
    def __init__(self, model) -> None:
        self.model = model
        self.servers = {w: _server(model, w) for w in ("w0", "w1")}
        self.index = KVIndex()
        self.listener = KVEventListener(self.index)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.call(self.listener.start())
        self.sync()
        self.ctx = zmq.Context()
        self.sink = self.ctx.socket(zmq.PULL)
        self.sink.bind("tcp://127.0.0.1:*")
        self.reply_to = self.sink.getsockopt(zmq.LAST_ENDPOINT).decode()

    def call(self, coro, timeout=10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def sync(self) -> None:
        async def go():
            self.listener.sync([_info(s) for s in self.servers.values()])

        self.call(go())

    def generate(self, wid: str, rid: str, prompt: list[int], max_tokens: int = 3) -> list[int]:
        push = self.ctx.socket(zmq.PUSH)
        push.connect(self.servers[wid].endpoint)
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        push.send(encode(GenerateRequest(rid, prompt, sp, self.reply_to)))
        deadline = time.time() + 30
        out: list[int] = []
        while True:
            assert self.sink.poll(int(max(1, deadline - time.time()) * 1000)), "no tokens"
            m = decode(self.sink.recv(), expect=TokenMessage)
            assert m.finish_reason != "error", m.error
            if m.request_id == rid:
                out += m.token_ids
                if m.finish_reason:
                    break
        push.close(linger=0)
        return out

    def held(self, wid: str) -> set[int]:
        bm = self.servers[wid].engine.block_manager
        return set(bm.cached_hashes())

    def wait_mirrored(self, wid: str, timeout: float = 10.0) -> None:
        deadline = time.time() + timeout
        while set(self.index.held(wid)) != self.held(wid) or not self.index.is_synced(wid):
            assert time.time() < deadline, (
                f"index {sorted(self.index.held(wid))} != worker {sorted(self.held(wid))}"
            )
            time.sleep(0.05)

    def close(self) -> None:
        self.call(self.listener.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.sink.close(linger=0)
        self.ctx.term()
        for s in self.servers.values():
            s.stop()


@pytest.fixture(scope="module")
def rig(make_tiny_model):
    r = Rig(make_tiny_model("llama"))
    yield r
    r.close()


def test_the_index_holds_exactly_each_workers_hashes(rig):
    rig.generate("w0", "a", list(range(1, 24)))
    rig.generate("w1", "b", list(range(50, 70)))
    for wid in ("w0", "w1"):
        rig.wait_mirrored(wid)
        assert rig.held(wid)  # something was cached, so the check means something
    assert not set(rig.index.held("w0")) & set(rig.index.held("w1"))


def test_kv_routing_picks_the_worker_holding_the_prefix(rig):
    first = list(range(200, 230))
    rig.generate("w1", "t1", first)
    rig.wait_mirrored("w1")
    view = LoadView([_info(s) for s in rig.servers.values()], BS)
    # The next turn: the first turn's prompt plus more. w1 holds its leading blocks.
    nxt = [*first, 5, 6, 7, 8, 9]
    plan = plan_route_kv(view, nxt, rig.index, disagg_threshold=16, decode_slack=0.25)
    assert plan.decode.worker_id == "w1" and plan.decode_hit_tokens >= 28
    plan = plan_route_kv(view, list(range(300, 335)), rig.index, disagg_threshold=16)
    assert plan.decode_hit_tokens == 0


def test_dropped_batches_are_resynced(rig):
    before = rig.listener.num_resyncs
    rig.servers["w0"].kv_events.drop_next = 2  # lost on the wire: the router never sees them
    rig.generate("w0", "c", list(range(400, 433)))
    rig.wait_mirrored("w0")  # the next heartbeat shows the gap; a snapshot fills it
    assert rig.listener.num_resyncs > before


def test_a_restarted_worker_is_resynced_and_a_leaving_one_forgotten(rig):
    rig.wait_mirrored("w1")
    assert rig.index.held("w1")
    old = rig.servers["w1"]
    old.stop()
    rig.servers["w1"] = _server(rig.model, "w1")  # a new incarnation, empty cache
    rig.sync()
    rig.wait_mirrored("w1")
    assert rig.index.held("w1") == {}
    rig.generate("w1", "d", list(range(600, 620)))
    rig.wait_mirrored("w1")
    # w0 leaves the directory: its entries go at once.
    gone = rig.servers.pop("w0")
    rig.sync()
    assert rig.index.held("w0") == {} and "w0" not in rig.index.workers()
    gone.stop()


def test_the_snapshot_socket_drops_bad_requests_and_keeps_answering(rig):
    from engine.kv_events import KVSnapshot, KVSnapshotRequest

    server = next(iter(rig.servers.values()))
    dealer = rig.ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(server.kv_events_endpoints[1])
    for bad in (b"", b"\xc1", encode(GenerateRequest("x", [1], SamplingParams(), rig.reply_to))):
        dealer.send(bad)
    dealer.send(encode(KVSnapshotRequest()))
    assert dealer.poll(5000), "no snapshot after bad requests"
    snap = decode(dealer.recv(), expect=KVSnapshot)
    assert snap.worker_id == server.worker_id and not dealer.poll(200)  # one answer only
    assert set(snap.tiers.get("device", [])) == rig.held(server.worker_id)
    dealer.close(linger=0)


def _all_blocks_free(rig, wid: str) -> bool:
    bm = rig.servers[wid].engine.block_manager
    return bm.num_free_blocks == bm.num_blocks


def test_dropped_events_resync_with_no_wrong_answer_and_no_leaked_block(rig, make_tiny_model):
    """Event batches lost while a conversation runs: the router notices the gap and resyncs,
    routes the next turns by what the worker really holds, and every answer equals the
    colocated engine's; every block is free once the requests end."""
    from engine import LLM

    wid = next(iter(rig.servers))
    turns = [list(range(700, 730))]
    turns += [turns[0] + [11, 12, 13, 14, 15], turns[0] + [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    before = rig.listener.num_resyncs
    rig.servers[wid].kv_events.drop_next = 1  # the batch storing the first turn's blocks
    got = [rig.generate(wid, "e0", turns[0])]
    deadline = time.time() + 10
    while rig.servers[wid].kv_events.drop_next:  # flushed after the step that sent the tokens
        assert time.time() < deadline, "the batch was never built"
        time.sleep(0.02)
    rig.wait_mirrored(wid)
    assert rig.listener.num_resyncs > before
    for k, prompt in enumerate(turns[1:], start=1):
        view = LoadView([_info(s) for s in rig.servers.values()], BS)
        plan = plan_route_kv(view, prompt, rig.index, disagg_threshold=16)
        assert plan.decode.worker_id == wid and plan.decode_hit_tokens >= 28
        got.append(rig.generate(plan.decode.worker_id, f"e{k}", prompt))
    ref = LLM(rig.model, dtype="float32", block_size=BS).generate(
        turns, SamplingParams(max_tokens=3, temperature=0.0)
    )
    assert got == [o.token_ids for o in ref]
    assert _all_blocks_free(rig, wid)


def test_a_worker_killed_with_events_in_flight_is_forgotten_and_its_replacement_resyncs(rig):
    """A worker dies while its last batches are still on their way (here: never sent): the
    index must not keep what that incarnation held, and the replacement (a new incarnation,
    an empty cache) is mirrored exactly, then followed as it fills."""
    wid = sorted(rig.servers)[-1]
    rig.generate(wid, "k0", list(range(800, 830)))
    rig.wait_mirrored(wid)
    assert rig.index.held(wid)
    rig.servers[wid].kv_events.drop_next = 1_000  # in flight when it dies: never delivered
    rig.generate(wid, "k1", list(range(850, 880)))
    rig.servers[wid].stop()
    rig.servers[wid] = _server(rig.model, wid)
    rig.sync()
    rig.wait_mirrored(wid)
    assert rig.index.held(wid) == {}
    view = LoadView([_info(s) for s in rig.servers.values()], BS)
    plan = plan_route_kv(view, list(range(800, 835)), rig.index, disagg_threshold=16)
    assert plan.decode_hit_tokens == 0  # nothing routed to blocks the dead worker held
    rig.generate(wid, "k2", list(range(900, 930)))
    rig.wait_mirrored(wid)
    assert rig.index.held(wid) and _all_blocks_free(rig, wid)
