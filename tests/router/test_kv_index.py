"""The router's KV index (router/kv_index.py) as pure state, the engine's block events that feed
it (engine/kv_cache.py), the hash both sides share (engine/kv_events.py), and the kv-events
routing policy (router.routing.plan_route_kv) over it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine.kv_cache import BlockManager
from engine.kv_events import KVEvent, KVEventBatch, KVSnapshot, lookup_blocks, prefix_block_hashes
from engine.protocol import WorkerLoad, decode, encode
from router.directory import WorkerInfo
from router.kv_index import KVIndex, PromptHashes
from router.routing import LOCAL, REMOTE, LoadView, plan_route_kv

REPO = Path(__file__).resolve().parents[2]
BS = 4


def batch(seq, *events, wid="w0", inc="i1"):
    evs = [KVEvent(kind, h, tier) for kind, h, tier in events]
    return KVEventBatch(wid, inc, seq, BS, evs)


def snap(seq, hashes, wid="w0", inc="i1", host=()):
    tiers = {"device": list(hashes)} | ({"host": list(host)} if host else {})
    return KVSnapshot(wid, inc, seq, BS, tiers)


def synced(index: KVIndex, hashes=(), **kw) -> KVIndex:
    assert index.load_snapshot(snap(0, hashes, **kw)) is False
    return index


def test_in_order_batches_apply_and_a_gap_resyncs_then_replays():
    index = synced(KVIndex())
    assert index.apply(batch(1, ("stored", 10, "device"), ("stored", 11, "device"))) is False
    assert index.held("w0") == {10: "device", 11: "device"}
    # Batch 2 is lost: batch 3 is buffered, not applied, and a resync is asked for.
    assert index.apply(batch(3, ("removed", 10, "device"))) is True
    assert not index.is_synced("w0") and 10 in index.held("w0")
    assert index.apply(batch(4, ("stored", 13, "device"))) is True  # buffered while resyncing
    # The snapshot reflects batches up to 3; only 4 is replayed on top.
    assert index.load_snapshot(snap(3, [11, 12])) is False
    assert index.held("w0") == {11: "device", 12: "device", 13: "device"}
    assert index.is_synced("w0")
    assert index.holders(13) == {"w0": "device"} and index.holders(10) == {}


def test_a_heartbeat_past_our_seq_is_a_gap_and_duplicates_are_ignored():
    index = synced(KVIndex(), [1])
    assert index.apply(batch(0)) is False  # heartbeat at our seq
    assert index.apply(batch(1, ("stored", 2, "device"))) is False
    assert index.apply(batch(1, ("removed", 2, "device"))) is False  # a duplicate: ignored
    assert 2 in index.held("w0")
    assert index.apply(batch(2)) is True  # heartbeat: batch 2 never arrived


def test_a_new_incarnation_or_an_unknown_worker_resyncs():
    index = KVIndex()
    # A router that starts after the worker: its first batch asks for a snapshot.
    assert index.apply(batch(7, ("stored", 5, "device"))) is True
    assert index.load_snapshot(snap(6, [4])) is False  # batch 7 replayed after it
    assert index.held("w0") == {4: "device", 5: "device"}
    # The worker restarts: seq 1 of a new incarnation is not a duplicate, it is a resync.
    assert index.apply(batch(1, ("stored", 9, "device"), inc="i2")) is True
    assert index.load_snapshot(snap(1, [9], inc="i2")) is False
    assert index.held("w0") == {9: "device"} and index.holders(4) == {}
    assert index.num_entries == 1


def test_a_gap_among_buffered_batches_resyncs_again():
    index = synced(KVIndex())
    index.apply(batch(2, ("stored", 1, "device")))
    index.apply(batch(5, ("stored", 2, "device")))
    assert index.load_snapshot(snap(2, [1])) is True  # 3 and 4 are missing before 5
    assert not index.is_synced("w0")


def test_a_worker_that_leaves_is_forgotten():
    index = KVIndex()
    synced(index, [1, 2], wid="a")
    synced(index, [2, 3], wid="b")
    assert index.holders(2) == {"a": "device", "b": "device"}
    index.forget("a")
    assert index.holders(2) == {"b": "device"} and index.holders(1) == {}
    assert index.workers() == ["b"] and index.num_entries == 2


def test_the_index_is_bounded():
    index = synced(KVIndex(max_entries=3), [1, 2])
    index.apply(batch(1, *[("stored", h, "device") for h in (3, 4, 5)]))
    assert index.num_entries == 3 and index.num_overflow == 2
    index.apply(batch(2, ("removed", 5, "device"), ("removed", 1, "device")))  # 5: never indexed
    assert index.num_entries == 2 and set(index.held("w0")) == {2, 3}


def test_hits_are_leading_blocks_weighted_by_tier_and_need_the_same_block_size():
    index = synced(KVIndex(), [1, 2], host=[3])
    assert index.hit_tokens("w0", [1, 2, 3, 4], BS) == (3 * BS, 2.5 * BS)
    assert index.hit_tokens("w0", [9, 1, 2], BS) == (0, 0.0)  # a prefix, not any block
    assert index.hit_tokens("w0", [1, 2], BS * 2) == (0, 0.0)  # hashed for another size
    assert index.hit_tokens("nobody", [1], BS) == (0, 0.0)


def test_a_block_held_in_both_tiers_keeps_its_other_copy_when_one_leaves():
    index = synced(KVIndex())
    # Promoted back with its host copy kept: stored host, then stored device.
    index.apply(batch(1, ("stored", 5, "host"), ("stored", 5, "device")))
    assert index.held("w0") == {5: "device"} and index.num_entries == 1
    index.apply(batch(2, ("removed", 5, "device")))  # the device copy evicted again
    assert index.held("w0") == {5: "host"}
    assert index.hit_tokens("w0", [5], BS) == (BS, 0.5 * BS)
    index.apply(batch(3, ("stored", 5, "device"), ("removed", 5, "host")))  # host slot reused
    assert index.held("w0") == {5: "device"} and index.holders(5) == {"w0": "device"}
    index.apply(batch(4, ("removed", 5, "device")))
    assert index.held("w0") == {} and index.holders(5) == {} and index.num_entries == 0


def test_frames_round_trip_with_limits():
    b = batch(3, ("stored", -(1 << 63), "device"), ("removed", (1 << 63) - 1, "host"))
    assert decode(encode(b), expect=KVEventBatch) == b
    s = snap(3, [1, 2], host=[3])
    assert decode(encode(s), expect=KVSnapshot) == s


def test_block_manager_reports_stored_and_removed_hashes_the_router_computes():
    bm = BlockManager(num_blocks=4, block_size=BS)
    events: list[tuple[str, int, str]] = []
    bm.event_sink = lambda *e: events.append(e)
    prompt = list(range(100, 111))  # 2 full blocks + 3 tokens
    table, _ = bm.allocate(prompt)
    bm.commit(table, prompt, len(prompt))
    expected = prefix_block_hashes(prompt, BS, 2)
    assert events == [("stored", h, "device") for h in expected]
    assert sorted(bm.cached_hashes()) == sorted(expected)
    # A second owner of the same prefix registers nothing new.
    t2, cached = bm.allocate(prompt)
    assert cached == 2 * BS
    bm.commit(t2, prompt, len(prompt))
    assert len(events) == 2
    bm.free(t2)
    bm.free(table)
    events.clear()
    # Another prompt takes every block: the cached ones are evicted, each reported once.
    other = list(range(500, 516))
    t3, _ = bm.allocate(other)
    assert sorted(e for e in events) == sorted(("removed", h, "device") for h in expected)
    assert bm.cached_hashes() == []
    bm.free(t3)


def test_the_block_hash_is_the_same_in_every_process():
    """The router computes the hashes the workers publish, in another process: Python's own
    hash() of a chain seeded with None differs between processes (3.11), this must not."""
    prompt = list(range(7, 30))
    code = (
        "import json; from engine.kv_events import prefix_block_hashes as p; "
        f"print(json.dumps(p({prompt}, {BS}, 5)))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runs = [
        json.loads(subprocess.check_output([sys.executable, "-c", code], env=env, text=True))
        for _ in range(2)
    ]
    assert runs[0] == runs[1] == prefix_block_hashes(prompt, BS, 5)
    assert lookup_blocks(len(prompt), BS) == 5


def worker(wid, role, free=100, running=0, queued=0):
    load = WorkerLoad(wid, role, free, 100, running, 0, queued, extra={"block_size": BS})
    return WorkerInfo(wid, role, f"tcp://127.0.0.1:{5000 + len(wid)}", load)


def test_kv_routing_sends_a_prompt_where_its_prefix_is_held():
    prompt = list(range(40))  # 10 blocks; the cache may serve 9
    held = prefix_block_hashes(prompt, BS, 9)
    index = KVIndex()
    synced(index, held, wid="d1")
    synced(index, held[:2], wid="p1")
    view = LoadView(
        [worker(w, r) for w, r in (("d0", "decode"), ("d1", "decode"))]
        + [worker("p0", "prefill"), worker("p1", "prefill")]
    )
    # The decode worker holding 36 of 40 tokens lacks 4 < the threshold: prefilled there.
    plan = plan_route_kv(view, prompt, index, disagg_threshold=8, decode_slack=0.25)
    assert (plan.path, plan.decode.worker_id, plan.decode_hit_tokens) == (LOCAL, "d1", 36)
    assert plan.computed_tokens == 4  # what the planner's demand counts for it
    # A lower threshold sends it to the prefill pool, to the worker with the most cached.
    plan = plan_route_kv(view, prompt, index, disagg_threshold=2, decode_slack=0.25, pull=False)
    assert (plan.path, plan.prefill.worker_id, plan.prefill_hit_tokens) == (REMOTE, "p1", 8)
    assert plan.computed_tokens == 32 and plan.prefix_source is None
    # With prefix pull (the default), p1 is told to READ d1's 36 tokens: it computes 4.
    plan = plan_route_kv(view, prompt, index, disagg_threshold=2, decode_slack=0.25)
    assert (plan.prefix_source.worker_id, plan.prefix_source_tokens) == ("d1", 36)
    assert plan.computed_tokens == 4
    # Affinity by hit has a limit: a holder much busier than the other loses.
    view.states["d1"].running = 32
    plan = plan_route_kv(view, prompt, index, disagg_threshold=8, decode_slack=0.25, pull=False)
    assert plan.decode.worker_id == "d0" and plan.path == REMOTE
    # With prefix pull, d0 READs d1's 36 tokens and computes the 4 left: under the threshold.
    plan = plan_route_kv(view, prompt, index, disagg_threshold=8, decode_slack=0.25)
    assert (plan.path, plan.decode.worker_id) == (LOCAL, "d0")
    assert (plan.prefix_source.worker_id, plan.prefix_source_tokens) == ("d1", 36)
    # A worker the index has not synced looks empty, but that is not known: no demand figure.
    plan = plan_route_kv(view, prompt, index, disagg_threshold=100, decode_slack=0.25)
    assert (plan.path, plan.decode.worker_id, plan.computed_tokens) == (LOCAL, "d0", None)


def test_a_next_turn_stays_with_the_decode_worker_holding_its_history():
    """The ping-pong the multi-turn benchmark showed: the worker holding the history also
    still ran a request (here: a fifth of its KV, one running more than the other, as a
    load report taken just before the last turn ended says). KV usage is room, not cost:
    the holder keeps the turn and nothing is READ across."""
    prompt = list(range(40))
    index = KVIndex()
    synced(index, prefix_block_hashes(prompt, BS, 9), wid="d0")
    synced(index, wid="d1")
    view = LoadView([worker("d0", "decode", free=80, running=1), worker("d1", "decode")])
    plan = plan_route_kv(view, prompt, index, disagg_threshold=8, decode_slack=0.25)
    assert (plan.path, plan.decode.worker_id, plan.prefix_source) == (LOCAL, "d0", None)
    # Room still comes first: a holder without blocks for the prompt loses.
    view.states["d0"].free_blocks = 5
    plan = plan_route_kv(view, prompt, index, disagg_threshold=8, decode_slack=0.25)
    assert plan.decode.worker_id == "d1"
    # With nothing held anywhere, the lower batch pressure wins, then the lower usage.
    view = LoadView([worker("d0", "decode", free=60), worker("d1", "decode", free=90)])
    plan = plan_route_kv(view, list(range(900, 940)), index, disagg_threshold=8)
    assert plan.decode.worker_id == "d1"


def test_a_prefix_source_holds_a_block_more_and_never_is_the_prefill_worker():
    prompt = list(range(40))
    held = prefix_block_hashes(prompt, BS, 9)
    index = KVIndex()
    synced(index, held[:4], wid="p0")
    synced(index, held[:4], wid="p1")
    synced(index, held[:3], wid="d0")
    synced(index, held[:2], wid="d1")
    view = LoadView(
        [worker(w, r) for w, r in (("d0", "decode"), ("d1", "decode"))]
        + [worker("p0", "prefill"), worker("p1", "prefill", queued=500)]
    )
    plan = plan_route_kv(view, prompt, index, disagg_threshold=2)
    # p0 holds 16 tokens itself; p1 holds as many (no gain), d0 and d1 fewer.
    assert (plan.prefill.worker_id, plan.prefill_hit_tokens) == ("p0", 16)
    assert plan.prefix_source is None and plan.computed_tokens == 24
    synced(index, held[:5], wid="p1")  # now a block more than p0
    plan = plan_route_kv(view, prompt, index, disagg_threshold=2)
    assert plan.prefill.worker_id == "p0"  # p1's queue is longer than its extra block
    assert (plan.prefix_source.worker_id, plan.prefix_source_tokens) == ("p1", 20)
    assert plan.computed_tokens == 20
    # A holder lends from its host tier too (it copies those blocks back to read them).
    synced(index, held[:2], wid="d1", host=held[2:9])
    plan = plan_route_kv(view, prompt, index, disagg_threshold=2)
    assert (plan.prefix_source.worker_id, plan.prefix_source_tokens) == ("d1", 36)


def test_blocks_of_a_routed_prompt_count_as_held_until_events_or_the_ttl():
    prompt = list(range(40))
    hashes = prefix_block_hashes(prompt, BS, 9)
    index = synced(KVIndex())
    now = [100.0]
    index.clock = lambda: now[0]
    index.expect("w0", hashes[:3], ttl_s=5.0)
    assert index.hit_tokens("w0", hashes, BS) == (12, 12.0)
    assert index.hit_tokens("w0", hashes, BS, expected=False) == (0, 0.0)
    # Its events confirm block 0 and say block 1 was evicted: no longer expected.
    index.apply(batch(1, ("stored", hashes[0], "device"), ("removed", hashes[1], "device")))
    assert index.hit_tokens("w0", hashes, BS) == (4, 4.0)
    index.expect("w0", hashes[1:2], ttl_s=5.0)
    assert index.hit_tokens("w0", hashes, BS) == (12, 12.0)
    now[0] = 106.0  # past the TTL: what was never stored is forgotten
    assert index.hit_tokens("w0", hashes, BS) == (4, 4.0)
    index.expect("nobody", hashes)  # a worker not synced is not guessed at
    assert index.hit_tokens("nobody", hashes, BS) == (0, 0.0)


def test_a_salted_prompt_is_routed_by_its_salted_hashes():
    """cache_salt: the router hashes a salted prompt as the workers do (the salt seeds the
    chain), so a worker holding the prompt under another salt, or unsalted, holds none of it."""
    prompt = list(range(40))
    salted = prefix_block_hashes(prompt, BS, 9, salt="tenant-a")
    assert set(salted).isdisjoint(prefix_block_hashes(prompt, BS, 9))
    assert set(salted).isdisjoint(prefix_block_hashes(prompt, BS, 9, salt="tenant-b"))
    index = KVIndex()
    synced(index, salted, wid="d1")
    view = LoadView([worker(w, "decode") for w in ("d0", "d1")] + [worker("p0", "prefill")])
    hits = {
        salt: plan_route_kv(
            view, prompt, index, disagg_threshold=8, hashes=PromptHashes(prompt, salt)
        ).decode_hit_tokens
        for salt in ("tenant-a", "tenant-b", None)
    }
    assert hits == {"tenant-a": 36, "tenant-b": 0, None: 0}
