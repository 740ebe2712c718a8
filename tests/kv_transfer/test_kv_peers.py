"""Registry-only handshakes and incarnations: an agent exchanges KV only with the (name,
instance) pairs of its allowed map, on both ends; a restarted worker (same name, new instance)
cannot touch its old instance's leases, and those are freed at once.

The lease-table tests drive the sender's part directly; the others run real agents (NIXL,
ZMQ) in this process and in child processes, killed by the OS where a restart is simulated.
"""

from __future__ import annotations

import time

import pytest
import zmq
from kvx_helpers import LocalWorker, PeerProcess

from engine.protocol import decode, encode
from kv_transfer.errors import (
    HandshakeError,
    PeerNotAllowedError,
    StalePeerError,
    TransferError,
    UnknownPeerError,
)
from kv_transfer.messages import (
    MAX_SIDE_FRAME_BYTES,
    PROTOCOL_VERSION,
    Abort,
    ErrorReply,
    Hello,
    HelloReply,
    PeerPolicy,
    ReadDone,
    ReadFailed,
    Released,
    Renew,
)
from kv_transfer.sender import LeaseTable

CHUNKED = {"max_read_bytes": 4 * 16384}  # 4 blocks per READ: a 64-block request takes 16


# ---------------------------------------------------------------------- the policy itself


def test_policy_names_the_peer_and_its_instance():
    policy = PeerPolicy({"d0": "inst-2"})
    assert policy.refusal("p0", "d0", "inst-2") is None
    stale = policy.refusal("p0", "d0", "inst-1")
    assert isinstance(stale, StalePeerError) and stale.fields == ("instance_id",)
    assert "inst-1" in str(stale) and "'d0'" in str(stale) and "inst-2" in str(stale)
    unknown = policy.refusal("p0", "d9", "inst-9")
    assert isinstance(unknown, UnknownPeerError) and unknown.fields == ("name",)
    assert "'d9'" in str(unknown) and "inst-9" in str(unknown)
    assert isinstance(unknown, PeerNotAllowedError) and isinstance(unknown, HandshakeError)
    assert policy.replaced("d0", "inst-1") and not policy.replaced("d0", "inst-2")
    assert not policy.replaced("d9", "x")  # removed or never listed: not a restart
    assert PeerPolicy().refusal("p0", "anyone", "any") is None  # default: allow any


def test_policy_copies_and_validates_its_map():
    peers = {"d0": "i1"}
    policy = PeerPolicy(peers)
    peers["d0"] = "i2"  # the caller's dict changing later changes nothing
    assert policy.allows("d0", "i1") and not policy.allows("d0", "i2")
    for bad in ({"": "i"}, {"d0": ""}, {"d0": 5}, {"d0": "x" * 65}, ["d0"]):
        with pytest.raises((TypeError, ValueError)):
            PeerPolicy(bad)


# ---------------------------------------------------------------------- the lease table


def _table() -> LeaseTable:
    table = LeaseTable(30.0, num_blocks=16, bytes_per_block=100, owner="p0")
    assert table.add_reader(b"old-sock", "d0", "inst-1") is None
    return table


def test_a_lease_belongs_to_the_instance_that_pinned_it():
    table = _table()
    table.hold("pinned", [1, 2], "d0")
    table.hold("unpinned", [3], "d0")
    assert table.on_renew(b"old-sock", Renew(1, ["pinned"])).statuses == ["ok"]
    # The old instance restarts: same name, new instance, new socket. Its pinned lease is
    # freed at once (its process is dead), the unpinned one stays held for the new instance.
    assert table.add_reader(b"new-sock", "d0", "inst-2") is None
    assert table.take_events() == [Released("pinned", (1, 2), "peer_restarted")]
    stats = table.stats()
    assert (stats.restarted_leases, stats.failures, table.num_held()) == (1, 1, 1)
    # The new instance cannot renew or abort what the old one pinned; the old one's socket
    # is gone; the unpinned lease is the new instance's to pin.
    reply = table.on_renew(b"new-sock", Renew(2, ["pinned", "unpinned"]))
    assert reply.statuses == ["unknown", "ok"]
    assert table.on_renew(b"old-sock", Renew(3, ["unpinned"])).statuses == ["unknown"]
    assert table.reader_name(b"old-sock") is None
    table.on_abort(b"new-sock", Abort("pinned", "not mine"))
    assert table.take_events() == []  # nothing released twice
    # Bound to the new instance now: the old one's identity no longer reaches it.
    table.on_abort(b"old-sock", Abort("unpinned", "zombie"))
    assert table.take_events() == [] and table.num_held() == 1


def test_a_new_map_drops_readers_and_releases_only_replaced_instances():
    table = _table()
    table.add_reader(b"e-sock", "e0", "inst-e")
    for rid, reader, sock in (("d-pinned", "d0", b"old-sock"), ("e-pinned", "e0", b"e-sock")):
        table.hold(rid, [len(rid)], reader)
        table.on_renew(sock, Renew(1, [rid]))
    table.hold("d-unpinned", [9], "d0")
    # d0 restarted (the registry names instance 2); e0 left the registry (maybe draining).
    table.set_policy(PeerPolicy({"d0": "inst-2"}))
    assert table.take_events() == [Released("d-pinned", (8,), "peer_restarted")]
    assert table.num_held() == 2  # e0's pinned lease runs to its expiry; d0's unpinned stays
    assert table.reader_name(b"old-sock") is None and table.reader_name(b"e-sock") is None
    # A Hello from an instance outside the map registers no reader; counted.
    refusal = table.add_reader(b"zombie", "d0", "inst-1")
    assert isinstance(refusal, StalePeerError) and table.reader_name(b"zombie") is None
    assert isinstance(table.add_reader(b"x", "x0", "i"), UnknownPeerError)
    assert table.stats().refused_peers == 2
    assert table.add_reader(b"new-sock", "d0", "inst-2") is None


# ---------------------------------------------------------------------- real agents


def _raw_hello(endpoint: str, sender_md: dict, name: str, instance: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send(
        encode(
            Hello(
                PROTOCOL_VERSION,
                name,
                instance,
                sender_md["compat_hash"],
                sender_md["compat_fields"],
            )
        )
    )
    return sock


def _answer(sock: zmq.Socket) -> object:
    assert sock.poll(5000), "the agent stopped answering"
    return decode(sock.recv(), MAX_SIDE_FRAME_BYTES)


def test_a_sender_refuses_a_reader_it_does_not_know():
    sender = LocalWorker("deny-snd", 32, agent={"lease_seconds": 1.0})
    receiver = PeerProcess("deny-rcv", 32)
    try:
        sender.agent.set_allowed_peers({"someone-else": "x"})
        baseline = len(sender.free)
        blocks = sender.alloc(4)
        dl = sender.agent.hold("denied", blocks, "deny-rcv")
        out = receiver.call("connect", metadata=sender.agent.metadata())
        assert out["error"].startswith("PeerNotAllowedError"), out
        assert "'deny-rcv'" in out["error"] and receiver.metadata["instance_id"] in out["error"]
        assert out["fields"] == ["name"]
        local = receiver.call("alloc", n=4)["blocks"]
        out = receiver.call(
            "start_read", rid="denied", peer="deny-snd", remote=blocks, local=local, deadline=dl
        )
        assert "not connected" in out["error"]
        # No reader was registered: a renewal on a socket whose Hello was refused is rejected.
        sock = _raw_hello(sender.agent.endpoint, sender.agent.metadata(), "intruder", "i-1")
        try:
            refused = _answer(sock)
            assert isinstance(refused, HelloReply) and not refused.ok
            assert "'intruder'" in refused.error and "i-1" in refused.error
            sock.send(encode(Renew(1, ["denied"])))
            assert isinstance(_answer(sock), ErrorReply)
        finally:
            sock.close()
        ev = sender.wait_for("denied", timeout=5)  # its lease frees the blocks
        assert isinstance(ev, Released) and ev.reason == "lease_expired"
        assert len(sender.free) == baseline
        stats = sender.agent.stats()
        assert (stats.refused_peers, stats.bytes_served) == (2, 0)
        assert receiver.call("stats")["bytes_read"] == 0
        # Once the registry lists it, the same reader is welcome.
        sender.agent.set_allowed_peers({"deny-rcv": receiver.metadata["instance_id"]})
        assert receiver.call("connect", metadata=sender.agent.metadata())["ok"]
    finally:
        receiver.close()
        sender.close()


def test_a_receiver_refuses_an_unknown_sender_without_dialling():
    sender = PeerProcess("deny2-snd", 32, agent={"lease_seconds": 1.0})
    receiver = LocalWorker("deny2-rcv", 32)
    try:
        receiver.agent.set_allowed_peers({"someone-else": "x"})
        remote = sender.call("alloc", n=3)["blocks"]
        sender.call("hold", rid="unasked", blocks=remote, peer="deny2-rcv")
        start = time.monotonic()
        with pytest.raises(UnknownPeerError, match="deny2-snd") as info:
            receiver.agent.connect(sender.metadata)
        assert time.monotonic() - start < 0.5  # no handshake timeout was waited out
        assert info.value.instance_id == sender.metadata["instance_id"]
        stats = receiver.agent.stats()
        assert (stats.refused_peers, stats.handshakes, stats.bytes_read) == (1, 0, 0)
        (rel,) = sender.wait_events(1, timeout=5)
        assert (rel["rid"], rel["reason"]) == ("unasked", "lease_expired")
        assert sender.call("stats")["bytes_served"] == 0
        assert sender.call("free_count")["free"] == 32
    finally:
        receiver.close()
        sender.close()


def test_a_stale_kvready_is_refused_without_dialling_and_never_read():
    """A sender restarts (new instance, same name); a KVReady of its old instance arrives
    late. The receiver refuses it before dialling, and never reads its block ids from the
    new instance either."""
    old = PeerProcess("inc-snd", 32)
    receiver = LocalWorker("inc-rcv", 32, agent={"peer_timeout_s": 30.0})
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    new = None
    try:
        old_md = old.metadata
        receiver.agent.set_allowed_peers({"inc-snd": old_md["instance_id"]})
        receiver.agent.connect(old_md)
        # A read in flight from the old instance (frozen: it never confirms the lease).
        remote = old.call("alloc", n=8)["blocks"]
        dl = old.call("hold", rid="in-flight", blocks=remote, peer="inc-rcv")["deadline"]
        old.freeze()
        receiver.agent.start_read("in-flight", "inc-snd", remote, receiver.alloc(8), dl)
        new = PeerProcess("inc-snd", 32)
        assert new.metadata["instance_id"] != old_md["instance_id"]
        # The registry learns the new incarnation: the old sender is dropped, its read fails.
        receiver.agent.set_allowed_peers({"inc-snd": new.metadata["instance_id"]})
        ev = receiver.wait_for("in-flight", timeout=5)
        assert isinstance(ev, ReadFailed) and old_md["instance_id"] in ev.reason, ev
        assert len(receiver.free) == 32
        old.kill()
        # The stale KVReady's sender metadata, pointed at a socket we watch: never dialled.
        stale = old_md | {"endpoint": f"tcp://127.0.0.1:{port}"}
        with pytest.raises(StalePeerError) as info:
            receiver.agent.connect(stale)
        assert old_md["instance_id"] in str(info.value) and "inc-snd" in str(info.value)
        assert new.metadata["instance_id"] in str(info.value)
        assert router.poll(300) == 0, "the receiver dialled a stale sender"
        assert receiver.agent.stats().refused_peers == 1
        # Connected to the new instance, a read naming the old one is refused too.
        receiver.agent.connect(new.metadata)
        remote = new.call("alloc", n=2)["blocks"]
        dl = new.call("hold", rid="fresh", blocks=remote, peer="inc-rcv")["deadline"]
        with pytest.raises(TransferError, match=old_md["instance_id"]):
            receiver.agent.start_read(
                "fresh", "inc-snd", remote, [0, 1], dl, sender_instance=old_md["instance_id"]
            )
        receiver.agent.start_read(
            "fresh",
            "inc-snd",
            remote,
            receiver.alloc(2),
            dl,
            sender_instance=new.metadata["instance_id"],
        )
        assert isinstance(receiver.wait_for("fresh", timeout=10), ReadDone)
    finally:
        router.close()
        receiver.close()
        old.kill()
        old.close()
        if new is not None:
            new.close()


@pytest.mark.parametrize("how", ["rehandshake", "registry"])
def test_a_restarted_reader_frees_its_old_instances_pinned_leases_at_once(how):
    """The receiver is killed with a READ pinned mid-transfer and restarted under the same
    name. Its old lease is freed at once (not lease_seconds later), as soon as the new
    instance handshakes (rehandshake) or the registry names it (registry); the new instance
    cannot renew or abort it; an unpinned lease for the name stays held and it can read it."""
    sender = LocalWorker(f"rs-snd-{how}", 128, agent={"lease_seconds": 30.0})
    old = PeerProcess(f"rs-rcv-{how}", 128, agent=CHUNKED)
    new = None
    name = old.name
    try:
        if how == "registry":
            sender.agent.set_allowed_peers({name: old.metadata["instance_id"]})
        baseline = len(sender.free)
        pinned = sender.alloc(64)
        dl = sender.agent.hold("pinned", pinned, name)
        unpinned = sender.alloc(2)
        dl2 = sender.agent.hold("unpinned", unpinned, name)
        assert old.call("connect", metadata=sender.agent.metadata())["ok"]
        local = old.call("alloc", n=64)["blocks"]
        out = old.call(
            "start_read",
            rid="pinned",
            peer=sender.agent.name,
            remote=pinned,
            local=local,
            deadline=dl,
            pause=60,  # loop stuck mid-transfer; its side channel's renewals pin the lease
        )
        assert out["state"] == "TRANSFERRING"
        time.sleep(0.3)
        sender.poll()
        assert sender.agent.num_held() == 2 and not sender.events
        old.kill()
        old.proc.wait(timeout=5)
        new = PeerProcess(name, 128)
        t0 = time.monotonic()
        if how == "registry":
            sender.agent.set_allowed_peers({name: new.metadata["instance_id"]})
        else:
            assert new.call("connect", metadata=sender.agent.metadata())["ok"]
        ev = sender.wait_for("pinned", timeout=5)
        assert isinstance(ev, Released) and ev.reason == "peer_restarted", ev
        assert time.monotonic() - t0 < 5  # not the 30 s lease
        stats = sender.agent.stats()
        assert (stats.restarted_leases, stats.failures) == (1, 1)
        assert sender.agent.num_held() == 1  # the unpinned lease waits for the new instance
        if how == "registry":
            assert new.call("connect", metadata=sender.agent.metadata())["ok"]
        # The new instance cannot renew the old instance's lease ("unknown" -> ReadFailed)...
        local = new.call("alloc", n=64)["blocks"]
        new.call(
            "start_read",
            rid="pinned",
            peer=sender.agent.name,
            remote=pinned,
            local=local,
            deadline=dl,
        )
        (failed,) = new.wait_events(1, timeout=10)
        assert failed["kind"] == "read_failed" and "unknown" in failed["reason"], failed
        # ...nor abort it (nothing released twice), but it reads the unpinned one.
        new.call("abort", rid="pinned", peer=sender.agent.name)
        local = new.call("alloc", n=2)["blocks"]
        new.call(
            "start_read",
            rid="unpinned",
            peer=sender.agent.name,
            remote=unpinned,
            local=local,
            deadline=dl2,
        )
        (done,) = new.wait_events(1, timeout=10)
        assert (done["kind"], done["rid"]) == ("read_done", "unpinned"), done
        rel = sender.wait_for("unpinned", timeout=5)
        assert isinstance(rel, Released) and rel.reason == "read_done"
        assert [e.request_id for e in sender.events] == ["pinned", "unpinned"]
        assert len(sender.free) == baseline
    finally:
        old.kill()
        old.close()
        if new is not None:
            new.close()
        sender.close()
