"""The agent's ZMQ side channel and the daemon thread that owns its sockets.

Sockets: one ROUTER bound on an OS-chosen port (receivers dial it: Hello, Renew, Abort), and
one DEALER per sender this agent reads from (created by `Receiver.connect` for the handshake,
then handed over with `adopt`, and closed by the thread after `retire`). ZMQ sockets are not
thread-safe, so after the hand-over only the thread touches them; the other parts queue their
frames and the thread sends them (`take_outgoing` of the sender and the receiver).

One round of the thread's loop:

    take NIXL notifications (non-blocking; this also progresses UCX) -> LeaseTable.on_notifs
    register adopted DEALERs, close retired ones; stop if asked to
    send queued frames
    wait for frames: 2 ms while reads, pinned leases or a recent handshake exist, else 100 ms
    ROUTER frames: Hello -> handshake answer (the allowed-peers map and compatibility
                   checked here, the reader registered with the LeaseTable, all refusals
                   answered HelloReply ok=False); Renew/Abort -> LeaseTable
    DEALER frames: -> Receiver (renew replies, aborts, error replies)
    every heartbeat_s: Receiver.beat (renewals, silent senders marked down)
    send queued frames

Every frame is one typed `engine.protocol` message under `max_frame_bytes`; a malformed, pickled,
oversized, multi-part or out-of-order frame is counted in `rejected_frames` and, on the
ROUTER, answered with an `ErrorReply` (the channel keeps serving). Every socket has ZMQ's
receive size cap (MAXMSGSIZE, 4x the frame limit: a peer sending more is disconnected before
the frame is buffered) and send/receive high-water marks (_HWM frames per peer: past it a send
is dropped and logged, never queued without bound); each round reads at most
_MAX_FRAMES_PER_ROUND frames per socket.

The thread never touches the engine. Its lock guards only the hand-over lists and flags below
and is never held while calling into another part.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

import zmq

from engine.protocol import WireError, decode, encode
from kv_transfer.errors import quietly
from kv_transfer.faults import FaultPlan
from kv_transfer.messages import (
    Abort,
    Compat,
    ErrorReply,
    Hello,
    HelloReply,
    Renew,
    RenewReply,
    TransferStats,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from kv_transfer.errors import PeerNotAllowedError
    from kv_transfer.nixl import NotifBatch

log = logging.getLogger(__name__)


# What the thread calls on the agent's other parts, as structural types: `sender.LeaseTable`
# and `receiver.Receiver` satisfy them, and this module imports neither (the receiver imports
# this one, so naming it here would close an import cycle).
class LeaseSide(Protocol):
    def on_notifs(self, notifs: NotifBatch) -> None: ...

    def refusal(self, name: str, instance_id: str) -> PeerNotAllowedError | None: ...

    def add_reader(
        self, identity: bytes, name: str, instance_id: str
    ) -> PeerNotAllowedError | None: ...

    def reader_name(self, identity: bytes) -> str | None: ...

    def on_renew(self, identity: bytes, renew: Renew) -> RenewReply: ...

    def on_abort(self, identity: bytes, abort: Abort) -> None: ...

    def any_pinned(self) -> bool: ...

    def take_outgoing(self) -> list[tuple[bytes, Any]]: ...


class ReadSide(Protocol):
    def busy(self) -> bool: ...

    def on_frames(self, name: str, sock: zmq.Socket, frames: list[Any]) -> None: ...

    def beat(self, now: float) -> None: ...

    def take_outgoing(self) -> list[tuple[zmq.Socket, Any]]: ...


_HANDSHAKE_BUSY_S = 5.0  # after a handshake the new pair's UCX wire-up needs our progress
_MAX_FRAMES_PER_ROUND = 256  # per socket, so other sockets and timers get their turn
# Frames queued per connection and direction. Legit traffic is a few frames per heartbeat per
# peer; this bounds what a flood can pin in memory to _HWM x MAXMSGSIZE per connection.
_HWM = 1024


class SideChannel:
    """ROUTER + DEALERs and their daemon thread; see the module docstring."""

    # Set by start(): what the thread serves.
    _compat: Compat
    _welcome: HelloReply
    _sender: LeaseSide
    _receiver: ReadSide
    _take_notifs: Callable[[bool], NotifBatch]
    _on_renew: Callable[[bytes, Renew], RenewReply | None]

    def __init__(
        self,
        name: str,
        bind_host: str,
        advertise_host: str | None,
        max_frame_bytes: int,
        heartbeat_s: float,
    ):
        self.name = name
        self._max_frame_bytes = max_frame_bytes
        self._heartbeat_s = heartbeat_s
        self._ctx = zmq.Context()
        self._router = self._socket(zmq.ROUTER)
        self._router.bind(f"tcp://{bind_host}:*")
        bound = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.endpoint = advertised_endpoint(bound, advertise_host)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()
        self._adopted: list[tuple[zmq.Socket, str]] = []
        self._retired: list[zmq.Socket] = []
        self._stopping = False
        self._last_hello = 0.0  # monotonic time of the last handshake, either direction
        self._rejected_frames = 0
        self._socks: dict[zmq.Socket, str] = {}  # the thread's: polled DEALERs -> sender name
        self._thread: threading.Thread | None = None

    def start(
        self,
        compat: Compat,
        welcome: HelloReply,
        sender: LeaseSide,
        receiver: ReadSide,
        take_notifs: Callable[[bool], NotifBatch],
        faults: FaultPlan | None = None,
    ) -> None:
        """Start serving: `welcome` is the HelloReply every compatible reader gets."""
        self._compat = compat
        self._welcome = welcome
        self._sender = sender
        # Bound once: the drop_renew_replies fault costs nothing when it is off.
        drop = faults is not None and faults.drop_renew_replies
        self._on_renew = self._renew_without_reply if drop else sender.on_renew
        self._receiver = receiver
        self._take_notifs = take_notifs
        self._thread = threading.Thread(target=self._run, name=f"kvx-{self.name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ other threads

    def dealer(self) -> zmq.Socket:
        """A new DEALER for a handshake; `adopt` it afterwards, or close it on failure."""
        return self._socket(zmq.DEALER)

    def adopt(self, sock: zmq.Socket, sender_name: str) -> None:
        """From now on `sock` is the thread's: frames on it go to the Receiver."""
        with self._lock:
            self._adopted.append((sock, sender_name))
        self.wake()

    def retire(self, sock: zmq.Socket) -> None:
        with self._lock:
            self._retired.append(sock)
        self.wake()

    def note_handshake(self) -> None:
        with self._lock:
            self._last_hello = time.monotonic()

    def wake(self) -> None:
        """Cut the thread's wait short: frames are queued or sockets changed."""
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake-up is pending anyway) or closed

    def stats(self) -> TransferStats:
        with self._lock:
            return TransferStats(rejected_frames=self._rejected_frames)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def close(self) -> None:
        """Close every socket and the context (after `stop`)."""
        for s in [self._router, *self._socks, *(s for s, _ in self._adopted), *self._retired]:
            quietly(s.close)
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)
        # A late wake() (an abort after close) must fail, not write into a reused fd number.
        self._wake_r = self._wake_w = -1

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_beat = time.monotonic()
        while True:
            self._sender.on_notifs(self._take_notifs(False))
            if not self._sync_sockets(poller):
                return
            self._flush()
            try:
                ready = dict(poller.poll(2 if self._busy() else 100))
            except zmq.ZMQError:
                return
            if self._wake_r in ready:
                _drain(self._wake_r)
            with self._lock:
                if self._stopping:
                    return
            try:
                next_beat = self._serve_round(ready, next_beat)
            except Exception:  # noqa: BLE001 - this thread must outlive any one bad round
                log.exception("side channel %s: a round failed; serving on", self.name)

    def _serve_round(self, ready: dict, next_beat: float) -> float:
        if self._router in ready:
            self._serve_router()
        for sock, name in list(self._socks.items()):
            if sock in ready:
                self._serve_peer(sock, name)
        now = time.monotonic()
        if now >= next_beat:
            next_beat = now + self._heartbeat_s
            self._receiver.beat(now)
        self._flush()
        return next_beat

    def _sync_sockets(self, poller: zmq.Poller) -> bool:
        """Take adopted and retired DEALERs; False when the channel is stopping."""
        with self._lock:
            if self._stopping:
                return False
            adopted, self._adopted = self._adopted, []
            retired, self._retired = self._retired, []
        for sock, name in adopted:
            self._socks[sock] = name
            poller.register(sock, zmq.POLLIN)
        for sock in retired:
            if self._socks.pop(sock, None) is not None:
                poller.unregister(sock)
            quietly(sock.close)
        return True

    def _busy(self) -> bool:
        with self._lock:
            recent_hello = time.monotonic() - self._last_hello < _HANDSHAKE_BUSY_S
        return recent_hello or self._receiver.busy() or self._sender.any_pinned()

    def _flush(self) -> None:
        for ident, msg in self._sender.take_outgoing():
            self._send(self._router, msg, ident)
        for sock, msg in self._receiver.take_outgoing():
            self._send(sock, msg)

    def _send(self, sock: zmq.Socket, msg: Any, ident: bytes | None = None) -> None:
        try:
            frame = encode(msg, self._max_frame_bytes)
            if ident is None:
                sock.send(frame, zmq.NOBLOCK)
            else:
                sock.send_multipart([ident, frame], zmq.NOBLOCK)
        except (zmq.ZMQError, WireError) as e:
            log.warning("side channel: dropping a %s frame: %s", type(msg).__name__, e)

    def _serve_router(self) -> None:
        for parts in self._recv(self._router):
            ident = parts[0]
            try:
                reply = self._on_router_message(ident, self._decode(parts[1:]))
            except WireError as e:
                reply = self._reject(e)
            except Exception as e:  # noqa: BLE001 - a frame that broke a handler: refuse it
                log.exception("side channel: a frame broke its handler")
                reply = self._reject(WireError(f"{type(e).__name__}: {e}"))
            if reply is not None:
                self._send(self._router, reply, ident)

    def _on_router_message(self, ident: bytes, msg: Any) -> Any:
        if isinstance(msg, Hello):
            return self._answer_hello(ident, msg)
        if self._sender.reader_name(ident) is None:
            raise WireError(f"{type(msg).__name__} before a handshake (or from a dropped peer)")
        if isinstance(msg, Renew):
            return self._on_renew(ident, msg)
        if isinstance(msg, Abort):
            self._sender.on_abort(ident, msg)
            return None
        raise WireError(f"unexpected {type(msg).__name__} on a sender's side channel")

    def _renew_without_reply(self, ident: bytes, renew: Renew) -> RenewReply | None:
        self._sender.on_renew(ident, renew)  # applied, never answered: a hung side channel
        return None

    def _answer_hello(self, ident: bytes, hello: Hello) -> HelloReply:
        """Refuse a peer outside the allowed map first (it learns nothing of our layout), then
        a layout mismatch; else register the reader and welcome it."""
        self.note_handshake()
        refusal = self._sender.refusal(hello.name, hello.instance_id)
        if refusal is None:
            fields, message = self._compat.mismatch(
                hello.protocol_version, hello.compat_hash, hello.compat_fields, for_peer=True
            )
            if fields:
                return self._refuse(message, fields)
            refusal = self._sender.add_reader(ident, hello.name, hello.instance_id)
        if refusal is not None:
            log.warning("side channel: refused a handshake: %s", refusal.reason)
            return self._refuse(refusal.reason, list(refusal.fields))
        return self._welcome

    def _refuse(self, error: str, fields: list[str]) -> HelloReply:
        w = self._welcome
        return HelloReply(
            ok=False,
            name=w.name,
            instance_id=w.instance_id,
            error=error[:4000],
            differing_fields=fields,
        )

    def _serve_peer(self, sock: zmq.Socket, name: str) -> None:
        frames = []
        for parts in self._recv(sock):
            try:
                frames.append(self._decode(parts))
            except WireError as e:
                self._reject(e, f" from {name}")  # no reply: a sender never asks us anything
        if frames:
            self._receiver.on_frames(name, sock, frames)

    def _recv(self, sock: zmq.Socket) -> list[list[bytes]]:
        out = []
        for _ in range(_MAX_FRAMES_PER_ROUND):
            try:
                out.append(sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        return out

    def _decode(self, parts: list[bytes]) -> Any:
        if len(parts) != 1:
            raise WireError(f"expected one frame, got {len(parts)}")
        return decode(parts[0], self._max_frame_bytes)

    def _reject(self, error: WireError, origin: str = "") -> ErrorReply:
        with self._lock:
            self._rejected_frames += 1
        log.warning("side channel: rejected a frame%s: %s", origin, error)
        return ErrorReply(f"rejected: {error}"[:4000])

    def _socket(self, kind: int) -> zmq.Socket:
        s = self._ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        # Past this ZMQ drops the connection before buffering the frame; decode() answers
        # frames between max_frame_bytes and this with an ErrorReply.
        s.setsockopt(zmq.MAXMSGSIZE, 4 * self._max_frame_bytes)
        s.setsockopt(zmq.SNDHWM, _HWM)
        s.setsockopt(zmq.RCVHWM, _HWM)
        return s


def advertised_endpoint(bound: str, advertise_host: str | None) -> str:
    """The endpoint peers should dial: a wildcard bind is advertised under a routable name."""
    host, _, port = bound.removeprefix("tcp://").rpartition(":")
    if advertise_host:
        host = advertise_host
    elif host in ("0.0.0.0", "*", "[::]"):
        host = socket.gethostbyname(socket.gethostname())
    return f"tcp://{host}:{port}"


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass
