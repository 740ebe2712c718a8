"""Leases, aborts and dead peers, with real processes killed by the OS (SIGKILL/SIGSTOP).

"Mid-transfer" is made real with small READ chunks and a paused worker loop: the receiver has
posted its first READ (state TRANSFERRING) and the rest is still to come when the kill lands.
"""

from __future__ import annotations

import hashlib
import signal
import time

import pytest
import torch
from kvx_helpers import LocalWorker, PeerProcess

from engine.protocol import encode
from kv_transfer.messages import ReadComplete, ReadDone, ReadFailed, Released

CHUNKED = {"max_read_bytes": 4 * 16384}  # 4 blocks per READ: a 64-block request takes 16


def test_unread_lease_expires_and_frees_the_blocks():
    sender = LocalWorker("lease-snd", 64, agent={"lease_seconds": 0.6})
    try:
        baseline = len(sender.free)
        blocks = sender.alloc(10)
        t0 = time.monotonic()
        deadline = sender.agent.hold("ghost-req", blocks, "nobody")
        assert abs(deadline - time.time() - 0.6) < 0.1
        ev = sender.wait_for("ghost-req", timeout=5)
        assert isinstance(ev, Released) and ev.reason == "lease_expired"
        assert 0.6 <= time.monotonic() - t0 < 1.5
        assert len(sender.free) == baseline
        assert sender.agent.stats().expired_leases == 1
    finally:
        sender.close()


def test_receiver_never_reads_under_a_known_expired_lease():
    sender = PeerProcess("exp-snd", 32)
    receiver = LocalWorker("exp-rcv", 32)
    try:
        receiver.agent.connect(sender.metadata)
        sender.call("hold", rid="late", blocks=[1, 2], peer="exp-rcv")
        receiver.agent.start_read("late", "exp-snd", [1, 2], receiver.alloc(2), time.time() - 1)
        ev = receiver.wait_for("late", timeout=5)
        assert isinstance(ev, ReadFailed) and "expired" in ev.reason
        assert receiver.agent.stats().bytes_read == 0
        # The receiver told the sender, which freed the blocks without waiting for its lease.
        (rel,) = sender.wait_events(1, timeout=5)
        assert rel["reason"] == "aborted"
        assert len(receiver.free) == 32
    finally:
        receiver.close()
        sender.close()


def test_receiver_killed_mid_transfer_sender_frees_after_lease():
    sender = LocalWorker("kill-r-snd", 128, agent={"lease_seconds": 1.0})
    receiver = PeerProcess("kill-r-rcv", 128, agent=CHUNKED)
    try:
        baseline = len(sender.free)
        blocks = sender.alloc(64)
        deadline = sender.agent.hold("victim", blocks, "kill-r-rcv")
        assert receiver.call("connect", metadata=sender.agent.metadata())["ok"]
        local = receiver.call("alloc", n=64)["blocks"]
        out = receiver.call(
            "start_read",
            rid="victim",
            peer="kill-r-snd",
            remote=blocks,
            local=local,
            deadline=deadline,
            pause=60,
        )
        assert out["state"] == "TRANSFERRING"
        time.sleep(0.3)  # renewals pin the lease while the receiver's loop is stuck
        sender.poll()
        assert sender.agent.num_held() == 1 and not sender.events
        assert receiver.call("state", rid="victim")["state"] == "TRANSFERRING"
        receiver.kill()
        t_kill = time.monotonic()
        ev = sender.wait_for("victim", timeout=5)
        assert isinstance(ev, Released) and ev.reason == "peer_failed"
        # lease_seconds after the last renewal, plus slack for a loaded 2-core box
        assert time.monotonic() - t_kill < 1.0 + 1.0
        assert len(sender.free) == baseline
        assert sender.agent.stats().failures == 1
    finally:
        receiver.close()
        sender.close()


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_sender_dies_mid_transfer_receiver_fails_within_deadline(how):
    """The sender is frozen (SIGSTOP, all threads stopped) before the receiver starts, so it
    can never confirm the lease; then it is killed (kill) or left hung (hang). kill: NIXL
    reports the disconnect or the side channel times out; hang: NIXL would wait forever, the
    missing renew replies end it after peer_timeout_s."""
    sender = PeerProcess(f"die-snd-{how}", 128)
    receiver = LocalWorker(
        f"die-rcv-{how}", 128, agent={**CHUNKED, "peer_timeout_s": 1.0, "heartbeat_s": 0.2}
    )
    try:
        receiver.agent.connect(sender.metadata)
        remote = sender.call("alloc", n=64)["blocks"]
        deadline = sender.call("hold", rid="orphan", blocks=remote, peer=receiver.agent.name)[
            "deadline"
        ]
        local = receiver.alloc(64)
        sender.freeze()
        receiver.agent.start_read("orphan", sender.name, remote, local, deadline)
        assert receiver.agent.transfer_state("orphan").name == "TRANSFERRING"
        receiver.poll()  # a few chunks land: the request is genuinely mid-transfer
        if how == "kill":
            sender.kill()
            sender.proc.wait(timeout=5)
        t0 = time.monotonic()
        ev = receiver.wait_for("orphan", timeout=10)
        elapsed = time.monotonic() - t0
        assert isinstance(ev, ReadFailed), ev
        expected = (
            ("DISCONNECT", "no answer on the side channel")
            if how == "kill"
            else ("no answer on the side channel",)
        )
        assert any(e in ev.reason for e in expected), ev.reason
        assert elapsed < 1.0 + 0.2 + 1.0  # peer_timeout_s + one heartbeat + slack
        assert len(receiver.free) == 128
        assert receiver.agent.stats().failures == 1
        assert receiver.agent.transfer_state("orphan") is None
    finally:
        sender.kill()
        receiver.close()
        sender.close()


def test_abort_from_either_side_frees_both_sides_and_late_notifs_are_ignored():
    sender = PeerProcess("ab-snd", 64)
    receiver = LocalWorker("ab-rcv", 64, agent=CHUNKED)
    try:
        receiver.agent.connect(sender.metadata)
        # Receiver aborts mid-read: ReadFailed(aborted) here, Released(aborted) there.
        remote = sender.call("alloc", n=32)["blocks"]
        dl = sender.call("hold", rid="a1", blocks=remote, peer="ab-rcv")["deadline"]
        receiver.agent.start_read("a1", "ab-snd", remote, receiver.alloc(32), dl)
        assert receiver.agent.abort("a1")
        ev = receiver.wait_for("a1", timeout=5)
        assert isinstance(ev, ReadFailed) and ev.reason == "aborted"
        (rel,) = sender.wait_events(1, timeout=5)
        assert (rel["rid"], rel["reason"]) == ("a1", "aborted")
        # Sender aborts before the receiver reads: its blocks go back at once and the
        # receiver's read is refused by the sender (never answered from freed blocks).
        remote = sender.call("alloc", n=4)["blocks"]
        dl = sender.call("hold", rid="a2", blocks=remote, peer="ab-rcv")["deadline"]
        assert sender.call("abort", rid="a2")["known"]
        (rel,) = sender.wait_events(1, timeout=5)
        assert (rel["rid"], rel["reason"]) == ("a2", "aborted")
        receiver.agent.start_read("a2", "ab-snd", remote, receiver.alloc(4), dl)
        ev = receiver.wait_for("a2", timeout=5)
        assert isinstance(ev, ReadFailed) and "aborted" in ev.reason
        assert sender.call("free_count")["free"] == 64
        assert len(receiver.free) == 64
        # A late notification for the aborted request, one for a request never held, and a
        # garbage one: all dropped, nothing released twice.
        nixl = receiver.agent.nixl  # only tests send raw notifs; real ones ride the last READ
        nixl.send_notif("ab-snd", encode(ReadComplete("a2")))
        nixl.send_notif("ab-snd", encode(ReadComplete("never-held")))
        nixl.send_notif("ab-snd", b"\x93not a frame")
        end = time.monotonic() + 5
        while sender.call("stats")["ignored_notifs"] < 3 and time.monotonic() < end:
            time.sleep(0.05)
        assert sender.call("stats")["ignored_notifs"] >= 3
        assert sender.call("events")["events"] == []
        # And the pair still works.
        remote = sender.call("alloc", n=2)["blocks"]
        dl = sender.call("hold", rid="a3", blocks=remote, peer="ab-rcv")["deadline"]
        receiver.agent.start_read("a3", "ab-snd", remote, receiver.alloc(2), dl)
        assert isinstance(receiver.wait_for("a3", timeout=10), ReadDone)
    finally:
        receiver.close()
        sender.close()


def test_renewals_keep_a_slow_readers_lease_and_a_lapsed_one_is_never_used():
    """The receiver's side-channel thread renews while its loop is stuck, so a read that
    outlives lease_seconds still completes byte-exact. A receiver frozen by the OS past the
    lease finds it expired and fails the read instead of using blocks the sender freed."""
    sender = LocalWorker("slow-snd", 128, agent={"lease_seconds": 1.0})
    receiver = PeerProcess("slow-rcv", 128, agent=CHUNKED)
    try:
        sender.cache.data.view(-1).view(torch.uint8).copy_(
            torch.randint(0, 256, (sender.cache.data.numel() * 2,), dtype=torch.uint8)
        )
        assert receiver.call("connect", metadata=sender.agent.metadata())["ok"]
        # 1) Stuck loop (no poll for 2.5 lease periods), renewals still flowing.
        blocks = sender.alloc(32)
        dl = sender.agent.hold("slow", blocks, "slow-rcv")
        local = receiver.call("alloc", n=32)["blocks"]
        receiver.call(
            "start_read",
            rid="slow",
            peer="slow-snd",
            remote=blocks,
            local=local,
            deadline=dl,
            pause=2.5,
        )
        end = time.monotonic() + 2.5
        while time.monotonic() < end:
            assert not sender.poll(), "the lease lapsed under a live reader"
            time.sleep(0.01)
        (ev,) = receiver.wait_events(1, timeout=10)
        assert (ev["kind"], ev["rid"]) == ("read_done", "slow")
        assert receiver.call("hashes", blocks=local)["hashes"] == [
            hashlib.sha256(sender.cache.data[b].view(torch.uint8).numpy().tobytes()).hexdigest()
            for b in blocks
        ]
        rel = sender.wait_for("slow", timeout=5)
        assert isinstance(rel, Released) and rel.reason == "read_done"
        # 2) The whole receiver process frozen past the lease: the sender frees the blocks;
        # on waking, the receiver learns the lease expired and reports FAILED, not done.
        blocks = sender.alloc(32)
        dl = sender.agent.hold("frozen", blocks, "slow-rcv")
        local = receiver.call("alloc", n=32)["blocks"]
        receiver.call(
            "start_read",
            rid="frozen",
            peer="slow-snd",
            remote=blocks,
            local=local,
            deadline=dl,
            pause=60,
        )
        time.sleep(0.3)  # pinned by a renewal
        receiver.freeze()
        rel = sender.wait_for("frozen", timeout=5)
        assert isinstance(rel, Released) and rel.reason == "peer_failed"
        receiver.kill(signal.SIGCONT)
        receiver.call("pause", seconds=0)
        (ev,) = receiver.wait_events(1, timeout=10)
        assert (ev["kind"], ev["rid"]) == ("read_failed", "frozen")
        assert "expired" in ev["reason"]
        assert receiver.call("free_count")["free"] == 128 - 32  # the first read's blocks kept
    finally:
        receiver.kill(signal.SIGCONT)
        receiver.close()
        sender.close()
