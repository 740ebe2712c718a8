"""A worker holding more block hashes than one frame carries answers a resync in parts, and
the router's listener merges them: over real ZMQ (a KVEventPublisher answering from its own
thread, a KVEventListener resyncing), the index ends with every hash of both tiers. A part
that does not fit the others (another seq) fails the resync instead of loading half."""

from __future__ import annotations

import asyncio
import threading
import time

import zmq

from engine.kv_events import KVEventPublisher, KVSnapshot
from engine.protocol import WorkerLoad, encode
from router.directory import WorkerInfo
from router.kv_index import KVIndex
from router.kv_listener import KVEventListener

HELD = {"device": list(range(1, 1501)), "host": list(range(-700, 0))}


def _serve(pub: KVEventPublisher, stop: threading.Event) -> None:
    while not stop.is_set():
        pub.serve_snapshots()
        time.sleep(0.005)


def _info(pub: KVEventPublisher) -> WorkerInfo:
    load = WorkerLoad("w", "decode", 10, 10, 0, 0, 0)
    return WorkerInfo("w", "decode", "tcp://127.0.0.1:1", load, pub.incarnation,
                      kv_events_endpoint=pub.endpoint,
                      kv_snapshot_endpoint=pub.snapshot_endpoint)  # fmt: skip


async def _resync(pub: KVEventPublisher, index: KVIndex) -> KVEventListener:
    listener = KVEventListener(index, max_frame_bytes=8192)
    await listener.start()
    listener.sync([_info(pub)])
    deadline = time.monotonic() + 10
    while not (listener.num_resyncs or listener.num_resync_failures):
        assert time.monotonic() < deadline, "no resync"
        await asyncio.sleep(0.02)
    await listener.stop()
    return listener


def test_a_snapshot_over_the_frame_cap_arrives_in_parts_and_is_merged() -> None:
    ctx = zmq.Context()
    pub = KVEventPublisher(ctx, "w", 16, lambda: HELD, max_frame_bytes=8192)
    parts = pub.snapshot_parts()
    assert len(parts) >= 3 and all(len(encode(p)) <= 8192 for p in parts)
    stop = threading.Event()
    thread = threading.Thread(target=_serve, args=(pub, stop), daemon=True)
    thread.start()
    try:
        index = KVIndex()
        listener = asyncio.run(_resync(pub, index))
        assert (listener.num_resyncs, listener.num_resync_failures) == (1, 0)
        held = index.held("w")
        assert len(held) == 2200 and index.is_synced("w")
        assert {h for h, t in held.items() if t == "host"} == set(HELD["host"])
    finally:
        stop.set()
        thread.join(5)
        pub.close()
        ctx.term()


def test_parts_that_do_not_fit_together_fail_the_resync() -> None:
    ctx = zmq.Context()
    pub = KVEventPublisher(ctx, "w", 16, lambda: HELD, max_frame_bytes=8192)
    real = pub.snapshot_parts

    def mixed() -> list[KVSnapshot]:
        parts = real()
        p = parts[-1]  # the last part claims a later seq: it belongs to another snapshot
        parts[-1] = KVSnapshot(p.worker_id, p.incarnation, p.seq + 1, p.block_size, p.tiers,
                               part=p.part, parts=p.parts)  # fmt: skip
        return parts

    pub.snapshot_parts = mixed
    stop = threading.Event()
    thread = threading.Thread(target=_serve, args=(pub, stop), daemon=True)
    thread.start()
    try:
        index = KVIndex()
        listener = asyncio.run(_resync(pub, index))
        assert (listener.num_resyncs, listener.num_resync_failures) == (0, 1)
        assert index.held("w") == {} and not index.is_synced("w")
    finally:
        stop.set()
        thread.join(5)
        pub.close()
        ctx.term()
