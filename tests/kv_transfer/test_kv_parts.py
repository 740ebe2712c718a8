"""The agent's parts on their own, without NIXL or sockets: the sender's lease table, the
handshake's compatibility check, and how the parts' counters add up."""

from __future__ import annotations

import time

import pytest

from engine.protocol import encode
from kv_transfer.errors import TransferError
from kv_transfer.messages import (
    PROTOCOL_VERSION,
    Abort,
    Compat,
    ReadComplete,
    Released,
    Renew,
    TransferStats,
)
from kv_transfer.sender import LeaseTable


def _table(lease_seconds: float = 10.0) -> LeaseTable:
    table = LeaseTable(lease_seconds, num_blocks=16, bytes_per_block=100)
    table.add_reader(b"id-d0", "d0", "inst-1")
    return table


def test_renew_pins_and_extends_only_for_the_named_reader():
    table = _table(lease_seconds=0.5)
    deadline = table.hold("r1", [1, 2], "d0")
    assert abs(deadline - time.time() - 0.5) < 0.1
    assert table.reader_name(b"id-d0") == "d0" and table.reader_name(b"stranger") is None
    table.add_reader(b"id-d1", "d1", "inst-7")
    other = table.on_renew(b"id-d1", Renew(1, ["r1"]))
    assert other.statuses == ["unknown"] and not table.any_pinned()
    reply = table.on_renew(b"id-d0", Renew(2, ["r1", "never-held"]))
    assert reply.statuses == ["ok", "unknown"] and 0.4 < reply.remaining_s[0] <= 0.5
    assert table.any_pinned()


def test_expiry_reports_a_silent_reader_apart_from_an_unread_lease():
    table = _table(lease_seconds=0.05)
    table.hold("unread", [1], "d0")
    table.hold("pinned", [2], "d0")
    table.on_renew(b"id-d0", Renew(1, ["pinned"]))
    table.expire(time.monotonic() + 1)
    reasons = {ev.request_id: ev.reason for ev in table.take_events()}
    assert reasons == {"unread": "lease_expired", "pinned": "peer_failed"}
    stats = table.stats()
    assert (stats.expired_leases, stats.failures, table.num_held()) == (2, 1, 0)
    # A renewal arriving after the release hears what happened, not "unknown".
    assert table.on_renew(b"id-d0", Renew(2, ["pinned"])).statuses == ["expired"]


def test_abort_of_a_pinned_lease_waits_for_the_reader():
    table = _table()
    table.hold("r1", [3, 4], "d0")
    table.on_renew(b"id-d0", Renew(1, ["r1"]))
    assert table.abort("r1") and not table.abort("unknown")
    assert table.take_outgoing() == [(b"id-d0", Abort("r1", "aborted by sender"))]
    assert table.take_events() == [] and table.num_held() == 1  # a READ may still land
    assert table.on_renew(b"id-d0", Renew(2, ["r1"])).statuses == ["aborted"]
    table.on_abort(b"id-d0", Abort("r1", "reader let go"))
    assert table.take_events() == [Released("r1", (3, 4), "aborted")]
    assert table.stats().aborted == 1


def test_notifications_release_only_the_readers_own_leases():
    table = _table()
    table.hold("r1", [5, 6, 7], "d0")
    table.hold("r2", [8], "d0")
    done = encode(ReadComplete("r1"))
    table.on_notifs({"d9": [encode(ReadComplete("r2"))], "d0": [done, done, b"\x93junk"]})
    assert table.take_events() == [Released("r1", (5, 6, 7), "read_done")]
    stats = table.stats()
    assert (stats.bytes_served, stats.ignored_notifs) == (300, 3)
    assert table.on_renew(b"id-d0", Renew(1, ["r1"])).statuses == ["done"]


def test_hold_refuses_bad_calls():
    table = _table()
    table.hold("r1", [0], "d0")
    for args in (("r1", [1], "d0"), ("r2", [16], "d0"), ("r2", [1, 1], "d0"), ("r2", [1], "")):
        with pytest.raises(TransferError):
            table.hold(*args)


def test_compat_names_the_fields_from_the_readers_side():
    mine = Compat({"block_size": "16", "dtype": "bfloat16"}, "h16")
    theirs = {"block_size": "32", "dtype": "bfloat16"}
    fields, message = mine.mismatch(PROTOCOL_VERSION, "h32", theirs)
    assert fields == ["block_size"] and message == "block_size: 16 here, 32 on peer"
    _, to_peer = mine.mismatch(PROTOCOL_VERSION, "h32", theirs, for_peer=True)
    assert to_peer == "block_size: 32 here, 16 on peer"
    assert mine.mismatch(PROTOCOL_VERSION + 1, "h16", dict(mine.fields))[0] == ["protocol_version"]
    assert mine.mismatch(PROTOCOL_VERSION, "other", dict(mine.fields))[0] == ["compat_hash"]
    assert mine.mismatch(PROTOCOL_VERSION, "h16", dict(mine.fields)) == ([], "")


def test_stats_of_the_parts_add_up():
    total = TransferStats(bytes_read=10, seconds=1e-8, failures=1) + TransferStats(failures=2)
    assert (total.bytes_read, total.failures, total.gbps) == (10, 3, pytest.approx(1.0))
