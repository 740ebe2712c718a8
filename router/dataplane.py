"""The router's ZMQ data plane: one PULL token sink, one PUSH socket per worker endpoint.

Lifecycle: `start()` binds the PULL socket on `bind_host` (port from the config or the OS) and
starts the receive loop; `register(rid)` opens a per-request queue before the request is sent;
the loop decodes each frame (`engine.protocol.decode`, size-limited, TokenMessage only) and puts it
on its request's queue; `unregister(rid)` drops the queue when the request ends, after which
late messages for it are discarded. A frame that does not decode is logged and counted, never
fatal. `send(endpoint, msg)` PUSHes one encoded message, connecting lazily; `retain(endpoints)`
closes sockets of workers that left the directory. `stop()` closes everything.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from engine.protocol import TokenMessage, WireError, decode, encode
from router.tasks import cancel_and_wait

log = logging.getLogger(__name__)

_BATCH = 256  # frames taken without waiting before the sink lets other tasks run


class SendError(RuntimeError):
    """A request could not be handed to a worker's socket in time."""


class DataPlane:
    def __init__(
        self,
        bind_host: str,
        port: int,
        advertise_host: str,
        max_frame_bytes: int,
        send_timeout_s: float = 5.0,
        on_bad_frame: Callable[[], None] | None = None,
    ) -> None:
        self.bind_host = bind_host
        self.port = port
        self.advertise_host = advertise_host
        self.max_frame_bytes = max_frame_bytes
        self.send_timeout_s = send_timeout_s
        self.on_bad_frame = on_bad_frame
        self.num_bad_frames = 0
        self.num_unknown = 0
        self.bound_endpoint = ""  # the address the PULL socket is bound to
        self.reply_endpoint = ""  # what workers are told to send to
        self._ctx: zmq.asyncio.Context | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._push: dict[str, zmq.asyncio.Socket] = {}
        self._queues: dict[str, asyncio.Queue[TokenMessage]] = {}
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        pull = self._ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        # ZMQ drops frames over 4x our limit without a trace; between 1x and 4x they arrive,
        # are counted and logged by `_handle`. The HWM bounds what waits unread.
        pull.setsockopt(zmq.MAXMSGSIZE, 4 * self.max_frame_bytes)
        pull.setsockopt(zmq.RCVHWM, 100_000)
        host = f"[{self.bind_host}]" if ":" in self.bind_host else self.bind_host
        if ":" in self.bind_host:
            pull.setsockopt(zmq.IPV6, 1)
        if self.port:
            pull.bind(f"tcp://{host}:{self.port}")
            port = self.port
        else:
            port = pull.bind_to_random_port(f"tcp://{host}")
        self._pull = pull
        self.bound_endpoint = pull.getsockopt_string(zmq.LAST_ENDPOINT)
        adv = f"[{self.advertise_host}]" if ":" in self.advertise_host else self.advertise_host
        self.reply_endpoint = f"tcp://{adv}:{port}"
        self._task = asyncio.create_task(self._recv_loop(), name="router-token-sink")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        for sock in self._push.values():
            sock.close(linger=0)
        self._push.clear()
        if self._pull is not None:
            self._pull.close(linger=0)
            self._pull = None
        if self._ctx is not None:
            # destroy, not term: term() blocks the loop thread until every socket of the
            # context is closed, so one socket left open would hang shutdown for good.
            self._ctx.destroy(linger=0)
            self._ctx = None

    # ------------------------------------------------------------------ token sink

    def register(self, request_id: str) -> asyncio.Queue[TokenMessage]:
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        q: asyncio.Queue[TokenMessage] = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def inject(self, msg: TokenMessage) -> None:
        """Deliver a router-made message (e.g. a worker-left abort) as if a worker sent it."""
        q = self._queues.get(msg.request_id)
        if q is not None:
            q.put_nowait(msg)

    @property
    def num_inflight(self) -> int:
        return len(self._queues)

    async def _recv_loop(self) -> None:
        assert self._pull is not None
        # A synchronous view of the same socket: frames already queued are taken with plain
        # non-blocking receives, without the asyncio socket's future and poller bookkeeping per
        # frame (most of the sink's CPU under load); the asyncio receive only waits when empty.
        ready = zmq.Socket.shadow(self._pull.underlying)
        taken = 0
        while True:
            try:
                try:
                    parts = ready.recv_multipart(zmq.NOBLOCK)
                    taken += 1
                    if taken % _BATCH == 0:  # a sender that never pauses must not starve the loop
                        await asyncio.sleep(0)
                except zmq.Again:
                    parts = await self._pull.recv_multipart(copy=True)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                if e.errno == zmq.ETERM:
                    return
                log.error("token sink receive failed: %s", e)
                await asyncio.sleep(0.01)
                continue
            self._handle(parts)

    def _handle(self, parts: list[bytes]) -> None:
        if len(parts) != 1:
            self._bad(f"expected a single-part frame, got {len(parts)} parts")
            return
        try:
            msg = decode(parts[0], max_bytes=self.max_frame_bytes, expect=TokenMessage)
        except WireError as e:
            self._bad(str(e))
            return
        q = self._queues.get(msg.request_id)
        if q is None:
            # Late tokens of a finished, stopped or aborted request: expected, not an error.
            self.num_unknown += 1
            log.debug("dropping tokens for unknown request %s", msg.request_id)
            return
        q.put_nowait(msg)

    def _bad(self, why: str) -> None:
        self.num_bad_frames += 1
        if self.on_bad_frame is not None:
            self.on_bad_frame()
        # Rate-limited: a peer spraying garbage must not flood the log.
        n = self.num_bad_frames
        if n <= 10 or n % 1000 == 0:
            log.error("dropped a malformed frame on the token sink (%d so far): %s", n, why[:200])

    # ------------------------------------------------------------------ requests out

    def _socket(self, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._push.get(endpoint)
        if sock is None:
            if self._ctx is None:
                raise SendError("data plane is not started")
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            sock.connect(endpoint)
            self._push[endpoint] = sock
        return sock

    async def send(self, endpoint: str, msg: object) -> None:
        frame = encode(msg, max_bytes=self.max_frame_bytes)
        sock = self._socket(endpoint)
        try:
            await asyncio.wait_for(sock.send(frame), timeout=self.send_timeout_s)
        except TimeoutError as e:
            raise SendError(
                f"worker endpoint {endpoint} did not accept a message in {self.send_timeout_s}s"
            ) from e
        except zmq.ZMQError as e:
            raise SendError(f"sending to {endpoint} failed: {e}") from e

    def retain(self, endpoints: set[str]) -> None:
        for endpoint in [e for e in self._push if e not in endpoints]:
            self._push.pop(endpoint).close(linger=0)
