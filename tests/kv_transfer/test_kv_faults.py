"""The fault-injection seam: each FaultPlan knob takes the real path of the failure it
imitates, with real agents (one in this process, one in a child process), and an agent
without faults runs NIXL's own calls with nothing in between."""

from __future__ import annotations

import hashlib
import time

import msgpack
import pytest
import torch
from kvx_helpers import LocalWorker, PeerProcess

from kv_transfer.faults import INJECTED, FaultPlan
from kv_transfer.messages import ReadDone, ReadFailed


def test_plan_validates_and_travels_as_a_dict():
    plan = FaultPlan(read_delay_s=0.5, fail_reads=2, never_read=True, drop_renew_replies=True)
    wire = msgpack.unpackb(msgpack.packb(plan.to_dict()))
    assert FaultPlan.from_dict(wire) == plan
    assert FaultPlan.coerce(None) == FaultPlan() and FaultPlan.coerce(wire) == plan
    assert not FaultPlan().active and not FaultPlan(drop_renew_replies=True).on_receiver
    for bad in (
        {"read_delay_s": -1},
        {"read_delay_s": float("nan")},
        {"read_delay_s": True},
        {"fail_reads": -1},
        {"fail_reads": 1.5},
        {"never_read": 1},
        {"drop_renew_replies": "yes"},
    ):
        with pytest.raises(ValueError):
            FaultPlan.from_dict(bad)
    with pytest.raises(ValueError, match="fail_writes"):
        FaultPlan.from_dict({"fail_writes": 1})
    with pytest.raises(TypeError):
        FaultPlan.from_dict([("fail_reads", 1)])


def test_an_agent_without_faults_calls_nixl_directly():
    worker = LocalWorker("nofault", 8)
    faulty = LocalWorker("faulty", 8, agent={"faults": {"fail_reads": 1}})
    try:
        agent = worker.agent
        assert agent.faults == FaultPlan()
        # Bound once at construction to the NIXL endpoint's own methods: no wrapper, no flag.
        rx = agent._receiver
        assert (rx._post, rx._check, rx._release_xfer) == (
            agent.nixl.transfer,
            agent.nixl.check,
            agent.nixl.release,
        )
        assert rx._renews and agent._channel._on_renew == agent._sender.on_renew
        assert faulty.agent._receiver._post != faulty.agent.nixl.transfer
    finally:
        faulty.close()
        worker.close()


def _hashes(cache, blocks: list[int]) -> list[str]:
    return [
        hashlib.sha256(cache.data[b].view(torch.uint8).numpy().tobytes()).hexdigest()
        for b in blocks
    ]


def test_fail_reads_takes_the_real_failure_path_then_reads_succeed():
    sender = PeerProcess("fr-snd", 32, agent={"lease_seconds": 30.0})
    receiver = LocalWorker("fr-rcv", 32, agent={"faults": FaultPlan(fail_reads=1)})
    try:
        assert sender.call("fill", seed=3)["ok"]
        receiver.agent.connect(sender.metadata)
        remote = sender.call("alloc", n=4)["blocks"]
        dl = sender.call("hold", rid="f1", blocks=remote, peer="fr-rcv")["deadline"]
        receiver.agent.start_read("f1", "fr-snd", remote, receiver.alloc(4), dl)
        ev = receiver.wait_for("f1", timeout=10)
        assert isinstance(ev, ReadFailed) and f"{INJECTED} fail_reads" in ev.reason, ev
        assert len(receiver.free) == 32
        # The sender was told (not left to its 30 s lease) once the handle was released.
        (rel,) = sender.wait_events(1, timeout=5)
        assert (rel["rid"], rel["reason"]) == ("f1", "aborted")
        # The next READ is a real one, byte-exact, over the same connection.
        dl = sender.call("hold", rid="f2", blocks=remote, peer="fr-rcv")["deadline"]
        local = receiver.alloc(4)
        receiver.agent.start_read("f2", "fr-snd", remote, local, dl)
        assert isinstance(receiver.wait_for("f2", timeout=10), ReadDone)
        assert _hashes(receiver.cache, local) == sender.call("hashes", blocks=remote)["hashes"]
        stats = receiver.agent.stats()
        assert (stats.failures, stats.transfers) == (1, 1)
    finally:
        receiver.close()
        sender.close()


def test_never_read_lets_the_sender_lease_expire_and_fails_at_the_read_deadline():
    sender = PeerProcess("nr-snd", 32, agent={"lease_seconds": 1.0})
    receiver = LocalWorker(
        "nr-rcv", 32, agent={"read_timeout_s": 2.5, "faults": {"never_read": True}}
    )
    try:
        receiver.agent.connect(sender.metadata)
        remote = sender.call("alloc", n=6)["blocks"]
        dl = sender.call("hold", rid="ghost", blocks=remote, peer="nr-rcv")["deadline"]
        t0 = time.monotonic()
        receiver.agent.start_read("ghost", "nr-snd", remote, receiver.alloc(6), dl)
        # Never renewed: the sender's lease stays unpinned and expires on its own.
        (rel,) = sender.wait_events(1, timeout=5)
        assert (rel["rid"], rel["reason"]) == ("ghost", "lease_expired")
        assert sender.call("free_count")["free"] == 32
        assert receiver.agent.transfer_state("ghost").name == "TRANSFERRING"
        ev = receiver.wait_for("ghost", timeout=10)
        elapsed = time.monotonic() - t0
        assert isinstance(ev, ReadFailed) and "2.5s" in ev.reason, ev
        assert 2.5 <= elapsed < 2.5 + 2.0  # its own deadline, plus slack for a busy box
        assert len(receiver.free) == 32 and receiver.agent.stats().bytes_read == 0
        assert sender.call("stats")["bytes_served"] == 0
    finally:
        receiver.close()
        sender.close()


def test_read_delay_holds_each_read_back_with_the_lease_pinned():
    sender = LocalWorker("rd-snd", 32, agent={"lease_seconds": 1.0})
    receiver = PeerProcess("rd-rcv", 32, agent={"faults": {"read_delay_s": 1.5}})
    try:
        sender.cache.data.view(torch.uint8).copy_(
            torch.randint(0, 256, sender.cache.data.view(torch.uint8).shape, dtype=torch.uint8)
        )
        assert receiver.call("connect", metadata=sender.agent.metadata())["ok"]
        blocks = sender.alloc(5)
        dl = sender.agent.hold("slow", blocks, "rd-rcv")
        local = receiver.call("alloc", n=5)["blocks"]
        t0 = time.monotonic()
        out = receiver.call(
            "start_read", rid="slow", peer="rd-snd", remote=blocks, local=local, deadline=dl
        )
        assert out["state"] == "TRANSFERRING"
        # Held back past the 1 s lease: the renewals keep it (pinned), nothing lands yet.
        while time.monotonic() - t0 < 1.2:
            assert not sender.poll(), "the lease lapsed or the READ landed early"
            time.sleep(0.02)
        assert receiver.call("state", rid="slow")["state"] == "TRANSFERRING"
        (ev,) = receiver.wait_events(1, timeout=10)
        assert (ev["kind"], ev["rid"]) == ("read_done", "slow"), ev
        assert time.monotonic() - t0 >= 1.5
        assert receiver.call("hashes", blocks=local)["hashes"] == _hashes(sender.cache, blocks)
    finally:
        receiver.close()
        sender.close()


def test_read_delay_makes_a_sender_kill_during_the_read_reproducible():
    sender = PeerProcess("rk-snd", 32)
    receiver = LocalWorker(
        "rk-rcv",
        32,
        agent={"peer_timeout_s": 1.0, "heartbeat_s": 0.2, "faults": {"read_delay_s": 1.0}},
    )
    try:
        receiver.agent.connect(sender.metadata)
        remote = sender.call("alloc", n=4)["blocks"]
        dl = sender.call("hold", rid="doomed", blocks=remote, peer="rk-rcv")["deadline"]
        receiver.agent.start_read("doomed", "rk-snd", remote, receiver.alloc(4), dl)
        time.sleep(0.3)  # the lease is pinned, the READ held back
        receiver.poll()
        assert receiver.agent.transfer_state("doomed").name == "TRANSFERRING"
        sender.kill()
        sender.proc.wait(timeout=5)
        t0 = time.monotonic()
        ev = receiver.wait_for("doomed", timeout=10)
        assert isinstance(ev, ReadFailed), ev
        assert "DISCONNECT" in ev.reason.upper() or "no answer on the side channel" in ev.reason
        assert time.monotonic() - t0 < 1.0 + 0.2 + 1.5  # peer_timeout_s + heartbeat + slack
        assert len(receiver.free) == 32 and receiver.agent.stats().bytes_read == 0
    finally:
        receiver.close()
        sender.close()


def test_drop_renew_replies_makes_readers_declare_the_sender_down():
    sender = PeerProcess("dr-snd", 32, agent={"faults": {"drop_renew_replies": True}})
    receiver = LocalWorker("dr-rcv", 32, agent={"peer_timeout_s": 1.0, "heartbeat_s": 0.2})
    try:
        receiver.agent.connect(sender.metadata)
        remote = sender.call("alloc", n=4)["blocks"]
        dl = sender.call("hold", rid="mute", blocks=remote, peer="dr-rcv")["deadline"]
        t0 = time.monotonic()
        receiver.agent.start_read("mute", "dr-snd", remote, receiver.alloc(4), dl)
        ev = receiver.wait_for("mute", timeout=10)
        # The READ may land, but with no confirmation the KV is never used.
        assert isinstance(ev, ReadFailed) and "no answer on the side channel" in ev.reason, ev
        assert time.monotonic() - t0 < 1.0 + 0.2 + 1.5
        assert receiver.agent.stats().transfers == 0
        # The sender itself works: the READ landed and its notification freed the blocks.
        (rel,) = sender.wait_events(1, timeout=10)
        assert (rel["rid"], rel["reason"]) == ("mute", "read_done"), rel
        assert sender.call("free_count")["free"] == 32
    finally:
        receiver.close()
        sender.close()
