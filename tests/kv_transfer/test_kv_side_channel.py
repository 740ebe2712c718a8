"""The side channel refuses malformed, oversized, pickled and out-of-order frames with an
ErrorReply and keeps serving; nothing on it is pickled."""

from __future__ import annotations

import pickle
import time

import msgpack
import pytest
import zmq
from kvx_helpers import LocalWorker, PeerProcess

from engine.protocol import WIRE_VERSION, encode
from engine.protocol import decode as decode_frame
from kv_transfer.messages import MAX_SIDE_FRAME_BYTES, ErrorReply, ReadDone, Renew


@pytest.fixture(scope="module")
def sender():
    proc = PeerProcess("sc-snd", 32)
    yield proc
    proc.close()


def _ask(sock: zmq.Socket, *parts: bytes) -> object:
    sock.send_multipart(list(parts))
    assert sock.poll(5000), "the agent stopped answering"
    return decode_frame(sock.recv(), MAX_SIDE_FRAME_BYTES)


BAD_FRAMES = {
    "garbage": [b"\xc1\xff\x00junk"],
    "pickle": [
        pickle.dumps({"v": WIRE_VERSION, "t": "kvx.renew", "d": {"seq": 1, "request_ids": []}})
    ],
    "not_a_frame_map": [msgpack.packb([1, 2, 3])],
    "unknown_type": [msgpack.packb({"v": WIRE_VERSION, "t": "os.system", "d": {}})],
    "bad_field": [
        msgpack.packb({"v": WIRE_VERSION, "t": "kvx.renew", "d": {"seq": -5, "request_ids": []}})
    ],
    "extra_field": [
        msgpack.packb({"v": WIRE_VERSION, "t": "kvx.abort", "d": {"request_id": "x", "y": 1}})
    ],
    "oversized": [b"\x00" * (MAX_SIDE_FRAME_BYTES + 1)],
    "two_parts": [encode(Renew(1, [])), b"second part"],
    "renew_before_handshake": [encode(Renew(1, ["r"]))],
}


@pytest.mark.parametrize("kind", sorted(BAD_FRAMES))
def test_bad_frames_get_an_error_reply(sender, kind):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sender.metadata["endpoint"])
    try:
        reply = _ask(sock, *BAD_FRAMES[kind])
        assert isinstance(reply, ErrorReply)
        assert reply.message.startswith("rejected")
    finally:
        sock.close()


def test_agent_keeps_working_after_bad_frames(sender):
    stats = sender.call("stats")
    assert stats["rejected_frames"] >= len(BAD_FRAMES)
    receiver = LocalWorker("sc-rcv", 32)
    try:
        receiver.agent.connect(sender.metadata)
        remote = sender.call("alloc", n=3)["blocks"]
        dl = sender.call("hold", rid="after-junk", blocks=remote, peer="sc-rcv")["deadline"]
        receiver.agent.start_read("after-junk", "sc-snd", remote, receiver.alloc(3), dl)
        assert isinstance(receiver.wait_for("after-junk", timeout=10), ReadDone)
    finally:
        receiver.close()


def test_frames_on_the_wire_are_msgpack_maps():
    frame = encode(Renew(3, ["a", "b"]))
    assert msgpack.unpackb(frame) == {
        "v": WIRE_VERSION,
        "t": "kvx.renew",
        "d": {"seq": 3, "request_ids": ["a", "b"]},
    }
    assert frame[0] == 0x83  # a msgpack fixmap of 3 entries; a pickle starts with 0x80


def test_receiver_rejects_junk_from_a_sender_and_stays_alive():
    """A DEALER->ROUTER pair where the 'sender' is a raw socket that answers a Hello with
    junk: connect() raises a HandshakeError instead of crashing or hanging."""
    from kv_transfer.errors import HandshakeError

    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    receiver = LocalWorker("junk-rcv", 8)
    try:
        md = receiver.agent.metadata() | {"name": "fake", "endpoint": f"tcp://127.0.0.1:{port}"}
        import threading

        def answer() -> None:
            if router.poll(5000):
                ident, _ = router.recv_multipart()
                router.send_multipart([ident, b"\xc1junk"])

        t = threading.Thread(target=answer)
        t.start()
        start = time.monotonic()
        with pytest.raises(HandshakeError, match="malformed reply"):
            receiver.agent.connect(md)
        t.join()
        assert time.monotonic() - start < 5
        assert receiver.agent.poll() == []
    finally:
        receiver.close()
        router.close()


def test_every_side_channel_socket_has_size_and_queue_limits():
    """ROUTER and DEALERs come from one factory: ZMQ's receive cap above the frame limit and
    explicit high-water marks, so neither a huge frame nor a flood is buffered unbounded."""
    from kv_transfer.side_channel import SideChannel

    channel = SideChannel("limits", "127.0.0.1", None, MAX_SIDE_FRAME_BYTES, 0.1)
    dealer = channel.dealer()
    try:
        for sock in (channel._router, dealer):
            assert sock.getsockopt(zmq.MAXMSGSIZE) == 4 * MAX_SIDE_FRAME_BYTES
            for hwm in (zmq.SNDHWM, zmq.RCVHWM):
                assert 0 < sock.getsockopt(hwm) <= 4096
    finally:
        dealer.close()
        channel.close()


def test_a_frame_over_zmqs_cap_is_dropped_with_its_connection(sender):
    ctx = zmq.Context.instance()
    huge = ctx.socket(zmq.DEALER)
    huge.setsockopt(zmq.LINGER, 0)
    huge.connect(sender.metadata["endpoint"])
    try:
        huge.send(b"\x00" * (4 * MAX_SIDE_FRAME_BYTES + 1))
        assert not huge.poll(1000), "a frame over MAXMSGSIZE was buffered and answered"
    finally:
        huge.close()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sender.metadata["endpoint"])
    try:
        assert isinstance(_ask(sock, b"\xc1junk"), ErrorReply)  # still serving
    finally:
        sock.close()
